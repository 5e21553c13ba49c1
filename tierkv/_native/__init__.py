"""The C extensions (sources in ``native/``): ``_lookup`` (the shared lookup index's table) and
``_ntcopy`` (streaming-store copies). Both are optional; their users fall back when a build lacks them."""

"""The codec interface.

A codec turns one raw block into a few sections and back. The pipeline (``block.py``) owns
everything around it: the container header, the zstd stage, checksums and all size checks, so a codec's
``decode`` only ever sees sections of exactly the sizes its ``section_sizes`` declared.

Primitives: ``make_params`` (validate encode options), ``section_sizes``, ``encode``, ``decode``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from tierkv.codecs.container import SCOPE_RAW, CodecError
from tierkv.codecs.zstdio import Policy
from tierkv.core.layout import Layout


class Codec(ABC):
    """One way of storing a block."""

    name: ClassVar[str]
    codec_id: ClassVar[int]  # part of the on-disk format
    checksum_scope: ClassVar[int] = SCOPE_RAW
    lossy: ClassVar[bool] = False
    # The declared error bound: the largest relative RMSE of the K half and of the V half of a block
    # (0.0: bit-exact). docs/design.md lists the measured figures on real KV.
    max_rel_rmse: ClassVar[float] = 0.0

    def make_params(self, layout: Layout, options: dict[str, Any]) -> dict[str, Any]:
        """Validate encode options (names without the codec prefix) into the parameters to store.

        Raises:
            ValueError: an unknown option or a bad value.
        """
        if options:
            raise ValueError(f"codec {self.name!r} takes no options, got {sorted(options)}")
        return {}

    def check_params(self, layout: Layout, params: dict[str, Any]) -> dict[str, Any]:
        """Validate parameters read from a header; :class:`CodecError` unless they are canonical."""
        try:
            canonical = self.make_params(layout, dict(params))
        except (ValueError, TypeError) as exc:
            raise CodecError(f"bad {self.name} parameters: {exc}") from None
        if canonical != params:
            raise CodecError(f"non-canonical {self.name} parameters")
        return canonical

    @abstractmethod
    def section_sizes(self, layout: Layout, params: dict[str, Any]) -> list[int]:
        """Decoded byte size of each section, from the layout and parameters alone."""

    @abstractmethod
    def encode(self, raw: np.ndarray, layout: Layout, params: dict[str, Any]) -> list[tuple[Any, Policy]] | None:
        """Split ``raw`` (uint8, ``layout.block_bytes``) into sections, each with its zstd policy.

        Returns ``None`` when this codec cannot take the block (the pipeline then stores it losslessly).
        """

    @abstractmethod
    def decode(self, sections: list[Any], layout: Layout, params: dict[str, Any], out: np.ndarray) -> None:
        """Rebuild the block into ``out`` (uint8, ``layout.block_bytes``) from the decoded sections."""

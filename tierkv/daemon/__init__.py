"""The daemon: server, request handling, the store/fetch/GPU paths, evictor, tuning, stats, start-up."""

"""The disk tier's checks: the start-up scan that rebuilds a record per stored value, and ``tierkv
verify``, which decodes every value and optionally drops the bad ones."""

from __future__ import annotations

import logging
import time

from tierkv.cache.block import Block
from tierkv.codecs import CodecError, decode_block, read_header
from tierkv.core.errors import TierKVError
from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.core.layout import Layout
from tierkv.daemon.parts import ScrubParts

log = logging.getLogger("tierkv.table")


def _record(st: ScrubParts, lk: bytes, value: memoryview) -> bool:
    """Record a stored value whose header names the key's namespace; False for a bad one."""
    try:
        h = read_header(value)
    except CodecError:
        return False
    if len(lk) <= FINGERPRINT_BYTES or bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
        return False
    st.diskp.added(st.table.add(Block(lk, h.raw_len, on_disk=True, disk_bytes=len(value))))
    return True


def scan_disk(st: ScrubParts) -> None:
    """Rebuild records of every block on disk; a value with a bad header is dropped."""
    assert st.disk is not None
    t0 = time.perf_counter()
    bad = [lk for lk, value in st.disk.scan() if not _record(st, lk, value)]
    # The scan reads headers through its own page walk; a value is dropped only if LMDB's own read
    # agrees that it is bad (a walk that went wrong must never cost stored blocks).
    bad = [lk for lk in bad if not _recheck(st, lk)]
    if bad:
        st.disk.delete(bad)
        st.diskp.stats.corrupt += len(bad)
    log.info("disk tier: %d blocks (%d dropped as corrupt) scanned in %.2fs", len(st.table), len(bad),
             time.perf_counter() - t0)


def _recheck(st: ScrubParts, lk: bytes) -> bool:
    """Re-check a value the start-up scan found bad, read through LMDB; a good one is recorded."""
    assert st.disk is not None

    def check(value: memoryview) -> int:
        if not _record(st, lk, value):
            raise CodecError("bad header or a namespace fingerprint that differs from the key's")
        return 1

    try:
        return bool(st.disk.read(lk, check))
    except (CodecError, TierKVError):
        return False


def verify(st: ScrubParts, drop: bool = False) -> dict:
    """Decode every disk value (header, sizes, checksum); report bad ones and optionally drop them."""
    if st.disk is None:
        return {"checked": 0, "bad": [], "dropped": 0}
    bad: list[dict] = []
    checked = 0
    for lk, value in st.disk.scan():
        checked += 1
        try:
            h = read_header(value)
            if bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
                raise CodecError("namespace fingerprint differs from the key's")
            decode_block(value, layout=Layout.from_dict(h.layout), fingerprint=lk[:FINGERPRINT_BYTES],
                         key=lk[FINGERPRINT_BYTES:])
        except (CodecError, ValueError) as exc:
            bad.append({"key": lk.hex(), "error": str(exc)})
    dropped = 0
    if drop and bad:
        keys = [bytes.fromhex(b["key"]) for b in bad]
        with st.lock:
            for fk in keys:
                b = st.table.get(fk)
                if b is not None and not b.protected:
                    if b.on_disk:
                        st.diskp.removed(b)
                    if b.host_off is None and b.gpu_off is None:
                        st.diskp.forget(b)
            st.diskp.stats.corrupt += len(keys)
        st.disk.delete(keys)
        dropped = len(keys)
    return {"checked": checked, "bad": bad, "dropped": dropped}

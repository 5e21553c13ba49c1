"""Paged gather/scatter: CPU path and kernel (host build, and CUDA where present) against a plain loop."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import zlib

import numpy as np
import pytest
import torch

from tierkv.client import paged
from tierkv.core.layout import Layout

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# (layers, heads, tokens, head_dim, engine blocks, n)
SHAPES = [(2, 2, 4, 8, 10, 3), (3, 4, 16, 64, 24, 7), (1, 1, 1, 1, 3, 2), (2, 3, 5, 12, 9, 9)]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.element_size()])


def rand_bits(shape, dtype, gen) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included): a copy must keep every bit."""
    isz = torch.empty((), dtype=dtype).element_size()
    idt = INT_VIEW[isz]
    lo, hi = (0, 256) if isz == 1 else (-(2 ** (8 * isz - 1)), 2 ** (8 * isz - 1) - 1)
    return torch.randint(lo, hi, shape, dtype=idt, generator=gen).view(dtype)


def make_caches(L, H, T, D, NB, dtype, layout, gen, *, style="list", device="cpu"):
    """Engine caches in a few real-world memory arrangements."""
    page = (T, H, D) if layout == "NHD" else (H, T, D)
    if style == "list":
        ks = [rand_bits((NB, *page), dtype, gen).to(device) for _ in range(L)]
        vs = [rand_bits((NB, *page), dtype, gen).to(device) for _ in range(L)]
        return ks, vs
    if style == "stacked":  # one [L, NB, ...] tensor each for K and V
        return rand_bits((L, NB, *page), dtype, gen).to(device), rand_bits((L, NB, *page), dtype, gen).to(device)
    if style == "kv_interleaved":  # vLLM >= 0.12 per-layer [NB, 2, ...]: K and V views with a 2x block stride
        layers = [rand_bits((NB, 2, *page), dtype, gen).to(device) for _ in range(L)]
        return [x[:, 0] for x in layers], [x[:, 1] for x in layers]
    raise AssertionError(style)


def ref_gather(ks, vs, ids, layout):
    """Plain per-token loop on raw bits."""
    L = len(ks)
    NB, a, b, D = ks[0].shape
    T, H = (a, b) if layout == "NHD" else (b, a)
    out = torch.zeros((len(ids), 2, L, H, T, D), dtype=INT_VIEW[ks[0].element_size()])
    for i, bid in enumerate(ids):
        for kv, caches in enumerate((ks, vs)):
            for layer in range(L):
                c = bits(caches[layer])
                for h in range(H):
                    for t in range(T):
                        out[i, kv, layer, h, t] = c[bid, t, h] if layout == "NHD" else c[bid, h, t]
    return out


def ref_scatter(blocks, ks, vs, ids, layout):
    """Plain per-token loop; returns new raw-bit caches."""
    L = len(ks)
    kb = [bits(c).clone() for c in ks]
    vb = [bits(c).clone() for c in vs]
    _, _, _, H, T, _ = blocks.shape
    src = bits(blocks)
    for i, bid in enumerate(ids):
        for kv, caches in enumerate((kb, vb)):
            for layer in range(L):
                for h in range(H):
                    for t in range(T):
                        if layout == "NHD":
                            caches[layer][bid, t, h] = src[i, kv, layer, h, t]
                        else:
                            caches[layer][bid, h, t] = src[i, kv, layer, h, t]
    return kb, vb


def slot_views(n, block_shape, dtype, gen, *, device="cpu", pin=False):
    """n block tensors carved out of one pool with gaps and in shuffled order (like shared-memory slots)."""
    elems = int(np.prod(block_shape))
    pool = torch.zeros((2 * n + 1) * elems + 3, dtype=dtype, device=device)
    if pin:
        pool = pool.pin_memory()
    order = torch.randperm(n, generator=gen).tolist()
    return [pool[(2 * j + 1) * elems:(2 * j + 2) * elems].view(block_shape) for j in order]


def assert_same_bits(a, b):
    assert torch.equal(bits(a.cpu()) if a.dtype.is_floating_point else a.cpu(),
                       bits(b.cpu()) if b.dtype.is_floating_point else b.cpu())


# ------------------------------------------------------------------------------------------ CPU path


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gather_matches_reference(shape, dtype, layout):
    L, H, T, D, NB, n = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, layout)).encode()))
    ks, vs = make_caches(L, H, T, D, NB, dtype, layout, gen)
    ids = torch.randint(0, NB, (n,), generator=gen).tolist()  # repeats allowed when gathering
    expect = ref_gather(ks, vs, ids, layout)

    out = torch.zeros((n, 2, L, H, T, D), dtype=dtype)
    assert paged.gather(ks, vs, ids, out, layout=layout) is out
    assert torch.equal(bits(out), expect)

    views = slot_views(n, (2, L, H, T, D), dtype, gen)
    paged.gather(ks, vs, torch.tensor(ids, dtype=torch.int32), views, layout=layout)
    assert torch.equal(torch.stack([bits(v) for v in views]), expect)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_matches_reference(shape, dtype, layout):
    L, H, T, D, NB, n = shape
    n = min(n, NB)
    gen = torch.Generator().manual_seed(1 + zlib.crc32(repr((shape, dtype, layout)).encode()))
    ks, vs = make_caches(L, H, T, D, NB, dtype, layout, gen)
    blocks = rand_bits((n, 2, L, H, T, D), dtype, gen)
    ids = torch.randperm(NB, generator=gen)[:n]
    exp_k, exp_v = ref_scatter(blocks, ks, vs, ids.tolist(), layout)

    k1, v1 = [c.clone() for c in ks], [c.clone() for c in vs]
    paged.scatter(blocks, k1, v1, ids, layout=layout)
    assert all(torch.equal(bits(a), b) for a, b in zip(k1 + v1, exp_k + exp_v))

    k2, v2 = [c.clone() for c in ks], [c.clone() for c in vs]
    views = slot_views(n, (2, L, H, T, D), dtype, gen)
    for v, b in zip(views, blocks):
        v.copy_(b)
    paged.scatter(views, k2, v2, ids.numpy(), layout=layout)
    assert all(torch.equal(bits(a), b) for a, b in zip(k2 + v2, exp_k + exp_v))


@pytest.mark.parametrize("style", ["stacked", "kv_interleaved"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_engine_memory_arrangements(style, layout):
    L, H, T, D, NB, n = 3, 2, 4, 16, 12, 5
    gen = torch.Generator().manual_seed(7)
    ks, vs = make_caches(L, H, T, D, NB, torch.bfloat16, layout, gen, style=style)
    ids = torch.randperm(NB, generator=gen)[:n].tolist()
    out = torch.empty((n, 2, L, H, T, D), dtype=torch.bfloat16)
    paged.gather(ks, vs, ids, out, layout=layout)
    assert torch.equal(bits(out), ref_gather(list(ks), list(vs), ids, layout))

    # Round trip: scatter the gathered blocks into other pages, gather them back.
    free = [b for b in range(NB) if b not in ids][:n]
    paged.scatter(out, ks, vs, free, layout=layout)
    back = torch.empty_like(out)
    paged.gather(ks, vs, free, back, layout=layout)
    assert torch.equal(bits(back), bits(out))


def test_batch_with_gaps_and_fp8():
    L, H, T, D, NB, n = 2, 2, 4, 8, 6, 3
    gen = torch.Generator().manual_seed(3)
    ks, vs = make_caches(L, H, T, D, NB, torch.float8_e4m3fn, "NHD", gen)
    # A batch whose blocks are contiguous but spaced apart (every other slot of a pool).
    pool = torch.zeros((2 * n, 2, L, H, T, D), dtype=torch.float8_e4m3fn)
    out = pool[::2]
    ids = [5, 0, 5]
    paged.gather(ks, vs, ids, out)
    assert torch.equal(bits(out), ref_gather(ks, vs, ids, "NHD"))
    assert not bits(pool[1::2]).any()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_slot_gather_in_small_groups(monkeypatch, layout):
    monkeypatch.setattr(paged.cpu, "_STAGE_BYTES", 1)  # one block per staging group
    L, H, T, D, NB, n = 2, 3, 4, 8, 7, 5
    gen = torch.Generator().manual_seed(17)
    ks, vs = make_caches(L, H, T, D, NB, torch.float16, layout, gen)
    ids = [6, 0, 3, 3, 1]
    views = slot_views(n, (2, L, H, T, D), torch.float16, gen)
    paged.gather(ks, vs, ids, views, layout=layout)
    assert torch.equal(torch.stack([bits(v) for v in views]), ref_gather(ks, vs, ids, layout))


def test_empty_is_a_no_op():
    ks, vs = make_caches(1, 1, 2, 4, 3, torch.float16, "NHD", torch.Generator().manual_seed(0))
    out = torch.empty((0, 2, 1, 1, 2, 4), dtype=torch.float16)
    paged.gather(ks, vs, [], out)
    paged.scatter([], ks, vs, torch.empty(0, dtype=torch.int64))


def test_engine_layout():
    ks, _ = make_caches(4, 2, 16, 8, 3, torch.bfloat16, "HND", torch.Generator().manual_seed(0))
    assert paged.engine_layout(ks, layout="HND") == Layout(4, 2, 8, 16, "bfloat16")
    ks, _ = make_caches(4, 2, 16, 8, 3, torch.float16, "NHD", torch.Generator().manual_seed(0))
    assert paged.engine_layout(ks) == Layout(4, 2, 8, 16, "float16")


# ------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def small():
    gen = torch.Generator().manual_seed(11)
    L, H, T, D, NB, n = 2, 2, 4, 8, 6, 3
    ks, vs = make_caches(L, H, T, D, NB, torch.float16, "NHD", gen)
    return ks, vs, torch.zeros((n, 2, L, H, T, D), dtype=torch.float16)


def test_bad_block_ids(small):
    ks, vs, out = small
    for ids in ([0, 1, 6], [-1, 0, 1], torch.tensor([0.0, 1.0, 2.0]), [True, False, True], [[0, 1, 2]],
                ["a", "b", "c"]):
        with pytest.raises(ValueError):
            paged.gather(ks, vs, ids, out)
    with pytest.raises(ValueError, match="repeat"):
        paged.scatter(out, ks, vs, [1, 2, 1])
    with pytest.raises(ValueError):
        paged.gather(ks, vs, [0, 1], out)  # n disagrees with the batch


def test_bad_shapes_and_dtypes(small):
    ks, vs, out = small
    with pytest.raises(ValueError):
        paged.gather(ks, vs, [0, 1, 2], out.to(torch.bfloat16))
    with pytest.raises(ValueError):
        paged.gather(ks, vs, [0, 1, 2], out[:, :, :, :, :2])
    with pytest.raises(ValueError):
        paged.gather(ks, vs[:1], [0, 1, 2], out)
    with pytest.raises(ValueError):
        paged.gather(ks, [vs[0], vs[1].float()], [0, 1, 2], out)
    with pytest.raises(ValueError):
        paged.gather(ks, [vs[0], vs[1][:, :2]], [0, 1, 2], out)
    with pytest.raises(ValueError):
        paged.gather(ks, vs, [0, 1, 2], out, layout="NTHD")
    with pytest.raises(ValueError):
        paged.gather([k[..., 0] for k in ks], [v[..., 0] for v in vs], [0, 1, 2], out)
    with pytest.raises(ValueError):  # head_dim not contiguous
        paged.gather([k.transpose(2, 3).contiguous().transpose(2, 3) for k in ks], vs, [0, 1, 2], out)
    with pytest.raises(ValueError):
        paged.gather([], [], [0, 1, 2], out)


def test_bad_block_lists(small):
    ks, vs, out = small
    views = list(out.unbind(0))
    with pytest.raises(ValueError):
        paged.gather(ks, vs, [0, 1], views)
    with pytest.raises(ValueError, match="share memory"):
        paged.gather(ks, vs, [0, 1, 2], [views[0], views[1], views[0]])
    with pytest.raises(ValueError, match="contiguous"):
        paged.gather(ks, vs, [0, 1, 2], [views[0], views[1], views[2].transpose(2, 3).contiguous().transpose(2, 3)])
    with pytest.raises(ValueError):
        paged.gather(ks, vs, [0, 1, 2], [views[0], views[1], "slot"])
    with pytest.raises(ValueError, match="contiguous"):
        paged.gather(ks, vs, [0, 1, 2], out.transpose(3, 4).contiguous().transpose(3, 4))


# ------------------------------------------------------------- the kernel source, built for the host


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    work = tmp_path_factory.mktemp("paged_emu")
    src, so = work / "paged_kv.cu", work / "paged_emu.so"
    src.write_text(paged.kernel_source())
    subprocess.run([cxx, "-x", "c++", "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                    "-DTIERKV_HOST_EMULATION", str(src), "-o", str(so)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.tierkv_paged_emulate.argtypes = [ctypes.c_longlong] * 5 + [ctypes.c_ulonglong] * 4 + [ctypes.c_longlong] * 11
    lib.tierkv_paged_emulate.restype = ctypes.c_int

    def run(ks, vs, ids, blocks, layout, to_engine):
        # The same plan and argument arrays the CUDA path builds, here on the CPU.
        plan = paged.kernel_plan(ks, vs, ids, blocks, layout=layout, to_engine=to_engine)
        addrs, keep = paged._arg_arrays(plan, torch.as_tensor(ids, dtype=torch.int64), torch.device("cpu"))
        rc = lib.tierkv_paged_emulate(plan.word, *plan.grid, *plan.block, *addrs, *plan.scalar_args(to_engine))
        assert rc == 0
        del keep
        return plan

    return run


def test_the_cuda_kernel_compiles_for_every_supported_architecture(tmp_path):
    """nvcc (CUDA 13) compiles the kernel for each GPU architecture tierkv supports, as NVRTC compiles it
    at first use on the engine's GPU: a kernel that no longer compiles fails here, without a GPU."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine (CUDA toolkit not installed)")
    src = tmp_path / "paged_kv.cu"
    src.write_text(paged.kernel_source())
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in paged.CUDA_ARCHS]
    r = subprocess.run([nvcc, "-std=c++17", "-c", str(src), "-o", str(tmp_path / "paged_kv.o"), "--threads", "0",
                        *gencode], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    listed = subprocess.run(["cuobjdump", "--list-elf", str(tmp_path / "paged_kv.o")], capture_output=True,
                            text=True) if shutil.which("cuobjdump") else None
    if listed is not None and listed.returncode == 0:
        assert all(f"sm_{a}" in listed.stdout for a in paged.CUDA_ARCHS), listed.stdout


def test_kernel_source_found_in_the_checkout(monkeypatch):
    monkeypatch.delenv("TIERKV_NATIVE_DIR", raising=False)
    assert "tierkv_paged_copy" in paged.kernel_source()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(2, 2, 4, 8, 10, 3), (2, 3, 5, 12, 9, 4), (1, 4, 16, 64, 6, 2)])
@pytest.mark.parametrize("as_list", [False, True])
def test_kernel_source_on_host(emulator, shape, dtype, layout, as_list):
    L, H, T, D, NB, n = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, layout, as_list)).encode()))
    ks, vs = make_caches(L, H, T, D, NB, dtype, layout, gen, style="kv_interleaved" if as_list else "list")
    ids = torch.randperm(NB, generator=gen)[:n].tolist()
    if as_list:
        out = slot_views(n, (2, L, H, T, D), dtype, gen)
    else:
        out = torch.zeros((n, 2, L, H, T, D), dtype=dtype)
    plan = emulator(ks, vs, ids, out, layout, False)
    got = torch.stack(out) if as_list else out
    assert torch.equal(bits(got), ref_gather(ks, vs, ids, layout)), plan

    blocks = rand_bits((n, 2, L, H, T, D), dtype, gen)
    src = list(blocks.clone().unbind(0)) if as_list else blocks
    exp_k, exp_v = ref_scatter(blocks, ks, vs, ids, layout)
    emulator(ks, vs, ids, src, layout, True)
    assert all(torch.equal(bits(a), b) for a, b in zip(ks + vs, exp_k + exp_v))


def test_kernel_plan_words_and_strides(emulator):
    gen = torch.Generator().manual_seed(5)
    L, H, T, D, NB, n = 2, 2, 4, 8, 6, 3
    ks, vs = make_caches(L, H, T, D, NB, torch.float16, "NHD", gen)
    out = torch.zeros((n, 2, L, H, T, D), dtype=torch.float16)
    plan = paged.kernel_plan(ks, vs, [0, 1, 2], out)
    assert plan.word == 16 and plan.head_words == 1 and plan.grid[0] == n * 2 * L
    assert (plan.s_blk, plan.s_tok, plan.s_head) == (T * H, H, 1)

    # Views one element off their allocation's alignment force 2-byte words; the result must not change.
    ks2 = [rand_bits((NB * T * H * D + 1,), torch.float16, gen)[1:].view(NB, T, H, D) for _ in range(L)]
    vs2 = [rand_bits((NB * T * H * D + 1,), torch.float16, gen)[1:].view(NB, T, H, D) for _ in range(L)]
    ids = [4, 1, 3]
    plan = emulator(ks2, vs2, ids, out, "NHD", False)
    assert plan.word == 2 and plan.head_words == D
    assert torch.equal(bits(out), ref_gather(ks2, vs2, ids, "NHD"))


def test_kernel_rows_split_across_grid_y(emulator, monkeypatch):
    # Many rows per chunk: several grid-y blocks; then a capped grid, so each thread makes many trips.
    gen = torch.Generator().manual_seed(9)
    L, H, T, D, NB, n = 1, 8, 160, 8, 4, 2
    ks, vs = make_caches(L, H, T, D, NB, torch.float32, "NHD", gen)
    for cap in (65535, 1):
        monkeypatch.setattr(paged, "_MAX_GRID_Y", cap)
        out = torch.zeros((n, 2, L, H, T, D), dtype=torch.float32)
        plan = emulator(ks, vs, [3, 1], out, "NHD", False)
        assert plan.grid[1] == (3 if cap > 1 else 1)
        assert torch.equal(bits(out), ref_gather(ks, vs, [3, 1], "NHD"))


def test_kernel_long_rows(emulator):
    # head_dim wider than a thread block's x extent: each thread walks several words of a row.
    gen = torch.Generator().manual_seed(13)
    L, H, T, D, NB, n = 1, 2, 3, 300, 3, 2
    ks = [rand_bits((NB * T * H * D + 1,), torch.float16, gen)[1:].view(NB, H, T, D) for _ in range(L)]
    vs = [rand_bits((NB * T * H * D + 1,), torch.float16, gen)[1:].view(NB, H, T, D) for _ in range(L)]
    out = torch.zeros((n, 2, L, H, T, D), dtype=torch.float16)
    plan = emulator(ks, vs, [2, 0], out, "HND", False)
    assert plan.word == 2 and plan.block == (256, 1)
    assert torch.equal(bits(out), ref_gather(ks, vs, [2, 0], "HND"))


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES + [(32, 8, 16, 128, 256, 64)])
def test_cuda_kernel_matches_cpu(shape, dtype, layout):
    L, H, T, D, NB, n = shape
    n = min(n, NB)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, layout)).encode()))
    # Device caches interleave K and V per layer (vLLM >= 0.12); the CPU reference gets plain copies.
    dks, dvs = make_caches(L, H, T, D, NB, dtype, layout, gen, style="kv_interleaved", device="cuda")
    ks, vs = [k.cpu() for k in dks], [v.cpu() for v in dvs]
    ids = torch.randperm(NB, generator=gen)[:n]
    expect = torch.empty((n, 2, L, H, T, D), dtype=dtype)
    paged.gather(ks, vs, ids, expect, layout=layout)

    out = torch.zeros((n, 2, L, H, T, D), dtype=dtype, device="cuda")
    paged.gather(dks, dvs, ids.cuda(), out, layout=layout)
    torch.cuda.synchronize()
    assert_same_bits(out, expect)

    views = slot_views(n, (2, L, H, T, D), dtype, gen, device="cuda")
    paged.gather(dks, dvs, ids.tolist(), views, layout=layout)
    torch.cuda.synchronize()
    assert_same_bits(torch.stack(views), expect)

    blocks = rand_bits((n, 2, L, H, T, D), dtype, gen)
    paged.scatter(blocks, ks, vs, ids, layout=layout)
    paged.scatter(blocks.cuda(), dks, dvs, ids, layout=layout)
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a.cpu()), bits(b)) for a, b in zip(dks + dvs, ks + vs))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_pinned_host_blocks_and_stream(layout):
    L, H, T, D, NB, n = 4, 8, 16, 128, 64, 16
    gen = torch.Generator().manual_seed(21)
    ks, vs = make_caches(L, H, T, D, NB, torch.bfloat16, layout, gen)
    ids = torch.randperm(NB, generator=gen)[:n].tolist()
    expect = ref_gather(ks, vs, ids, layout) if L * H * T * n <= 1 << 14 else None
    cpu_out = torch.empty((n, 2, L, H, T, D), dtype=torch.bfloat16)
    paged.gather(ks, vs, ids, cpu_out, layout=layout)
    if expect is not None:
        assert torch.equal(bits(cpu_out), expect)

    dks, dvs = [k.cuda() for k in ks], [v.cuda() for v in vs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    slots = slot_views(n, (2, L, H, T, D), torch.bfloat16, gen, pin=True)
    paged.gather(dks, dvs, ids, slots, layout=layout, stream=stream)
    stream.synchronize()
    assert_same_bits(torch.stack(slots), cpu_out)

    # Onboard from pinned slots into other pages, then read them back on the device.
    free = [b for b in range(NB) if b not in ids][:n]
    paged.scatter(slots, dks, dvs, free, layout=layout, stream=stream)
    back = torch.empty((n, 2, L, H, T, D), dtype=torch.bfloat16, device="cuda")
    paged.gather(dks, dvs, free, back, layout=layout, stream=stream)
    stream.synchronize()
    assert_same_bits(back, cpu_out)


@pytest.mark.gpu
@cuda
def test_cuda_rejects_pageable_host_blocks_and_bad_ids():
    ks = [torch.zeros((4, 2, 1, 8), device="cuda", dtype=torch.float16) for _ in range(2)]
    out = torch.zeros((2, 2, 2, 1, 2, 8), dtype=torch.float16)
    with pytest.raises(ValueError, match="pinned"):
        paged.gather(ks, ks, [0, 1], out)
    with pytest.raises(ValueError):
        paged.gather(ks, ks, torch.tensor([0, 4], device="cuda"), out.cuda())
    # Unchecked ids out of range are skipped by the kernel, never followed outside the caches.
    ks[0].fill_(1.0)
    dev_out = torch.zeros_like(out, device="cuda")
    paged.gather(ks, ks, torch.tensor([0, 4], device="cuda", dtype=torch.int32), dev_out, check_ids=False)
    torch.cuda.synchronize()
    assert bool((dev_out[0, :, 0] == 1).all()) and not dev_out[1].any()
    assert paged.kernel_backend() in ("cupy", "torch")

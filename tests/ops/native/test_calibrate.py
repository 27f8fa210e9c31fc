"""The native library's calibration (calibrate.py): the faster candidate of each setting is
chosen (a fake timer, so the test is deterministic), the build's default kept within the
margin; the cache is keyed by CPU and build, read back without measuring, and a corrupt file is
reported in one warning and measured again; concurrent first uses leave one whole file; and
every choice gives the float64 loop's results (the grouped GEMM's three products and the fused
SwiGLU FFN), bitwise the same whichever way B is read and the outputs are stored.

Legend: M rows, K contraction dim, N output dim, G groups.
"""
import itertools
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.native import calibrate, choice, ffn, load
from tests._support.gmm_reference import np_gmm, np_gmm_grads
from tests._support.ffn_reference import assert_matches_np_swiglu_ffn, ffn_operands

# the probe times of a fake machine, ms: (setting, candidate) -> time of each probe it runs
FAKE_MS = {("pack_b", "on"): 10.0, ("pack_b", "off"): 30.0,
           ("stream", "on"): 20.0, ("stream", "off"): 19.9,       # within the margin
           ("kernel_nn", "own"): 12.0, ("kernel_nn", "openblas"): 15.0,
           ("kernel_nn", "mkl"): 11.7,                              # within the margin
           ("kernel_nt", "own"): 12.0, ("kernel_nt", "openblas"): 8.0, ("kernel_nt", "mkl"): 8.1,
           ("kernel_tn", "own"): 12.0, ("kernel_tn", "openblas"): 11.0, ("kernel_tn", "mkl"): 9.0,
           ("kernel_gate_up", "own"): 30.0, ("kernel_gate_up", "openblas"): 20.0,
           ("kernel_gate_up", "mkl"): 21.0}
WANT = {"pack_b": "on", "stream": "on", "kernel_nn": "own", "kernel_nt": "openblas",
        "kernel_tn": "mkl", "kernel_gate_up": "openblas"}
DEFAULTS = calibrate._default_candidates(16)


class FakeMachine:
    """`apply` remembers the setting last set; `measure` returns its candidate's FAKE_MS (the
    probe's share), so the fastest candidate is known in advance."""

    def __init__(self):
        self.now, self.calls = None, 0

    def apply(self, name, cand):
        self.now = (name, cand)

    def measure(self, probe):
        self.calls += 1
        name, _ = self.now
        return FAKE_MS[self.now] / 1e3 / len(calibrate.SETTINGS[name][2])


class Flat:
    """A machine on which every candidate takes as long: a calibration keeps every default."""

    def __init__(self):
        self.calls = 0

    def __call__(self, probe):
        self.calls += 1
        return 0.01


@pytest.fixture
def lib():
    """The loaded library, every setting restored after the test (calibrate applies them)."""
    lib = load.library()
    saved = {sid: lib.dropless_setting(sid) for sid, _, _ in calibrate.SETTINGS.values()}
    yield lib
    for sid, value in saved.items():
        lib.dropless_set_setting(sid, value)


def test_the_faster_candidate_wins_and_the_default_keeps_its_place_within_the_margin():
    fake = FakeMachine()
    chosen, medians = calibrate.choose(fake.measure, fake.apply, DEFAULTS)
    # kernel_tn: mkl 25% faster (past the 5% margin); stream: "off" 0.5% faster and kernel_nn:
    # mkl 2.5% faster (within it)
    assert chosen == WANT
    assert medians["pack_b"] == {"on": 10.0, "off": 30.0}
    assert medians["kernel_nt"] == {"own": 12.0, "openblas": 8.0, "mkl": 8.1}
    assert fake.calls == calibrate.REPEATS * sum(len(c) * len(p) for _, c, p in
                                                 calibrate.SETTINGS.values())
    # the same fake machine, the same answer (deterministic), and a default that loses big
    again = FakeMachine()
    assert calibrate.choose(again.measure, again.apply, DEFAULTS)[0] == WANT
    slow = dict(DEFAULTS, pack_b="off")
    assert calibrate.choose(fake.measure, fake.apply, slow)[0]["pack_b"] == "on"
    # where MKL is not installed it is no candidate: the next fastest wins, nothing times it
    without = FakeMachine()
    chosen, medians = calibrate.choose(without.measure, without.apply, DEFAULTS,
                                       absent=frozenset({"mkl"}))
    assert chosen == dict(WANT, kernel_tn="openblas")
    assert all("mkl" not in m for m in medians.values())
    assert without.calls == calibrate.REPEATS * sum(
        len(set(c) - {"mkl"}) * len(p) for _, c, p in calibrate.SETTINGS.values())


def test_a_cached_choice_of_mkl_is_measured_again_where_mkl_is_absent(lib, tmp_path,
                                                                      monkeypatch):
    key = "cpu A\nbuild 1"
    calibrate.calibrate(lib, key, tmp_path, measure=Flat())
    file = calibrate.cache_file(tmp_path, key)
    entry = json.loads(file.read_text())
    file.write_text(json.dumps(dict(entry, chosen=dict(entry["chosen"], kernel_nn="mkl"))))
    monkeypatch.setattr(calibrate, "_absent", lambda lib: frozenset({"mkl"}))
    fake = Flat()
    got = calibrate.calibrate(lib, key, tmp_path, measure=fake)
    assert fake.calls > 0 and got.chosen["kernel_nn"] != "mkl" and got.how.startswith("measured")


def test_cached_per_cpu_and_build_and_read_back_without_measuring(lib, tmp_path):
    flat = Flat()
    got = calibrate.calibrate(lib, "cpu A\nbuild 1", tmp_path, measure=flat)
    defaults = calibrate._default_candidates(int(lib.dropless_vector_floats()))
    assert got.chosen == defaults and flat.calls > 0   # a tie keeps the build's default
    assert "measured" in got.how and str(tmp_path) in got.how
    for name, cand in got.chosen.items():   # the library now runs what was chosen
        sid, values, _ = calibrate.SETTINGS[name]
        assert lib.dropless_setting(sid) == values[cand]

    def never(probe):
        raise AssertionError("measured although cached")
    again = calibrate.calibrate(lib, "cpu A\nbuild 1", tmp_path, measure=never)
    assert again.chosen == got.chosen and again.how.startswith("read from")
    assert again.medians_ms == got.medians_ms
    # another build or another CPU: measured anew, into its own file
    other = Flat()
    calibrate.calibrate(lib, "cpu A\nbuild 2", tmp_path, measure=other)
    calibrate.calibrate(lib, "cpu B\nbuild 1", tmp_path, measure=other)
    assert other.calls == 2 * flat.calls
    assert len(list(tmp_path.glob("*.json"))) == 3
    assert not list(tmp_path.glob(".*"))   # no temporary file left


def test_the_key_is_the_cpu_the_build_the_workers_and_mkl():
    key = load.calibration_key(load.build())
    assert load.build().parent.name in key and "model name" in key and "workers" in key
    assert key.endswith(f"mkl {load.mkl_version() or 'none'}")
    assert load.calibration().key == key


@pytest.mark.parametrize("damage", ["truncated", "not json", "another key", "bad candidate"])
def test_a_corrupt_cache_file_is_named_in_one_warning_and_measured_again(lib, tmp_path, damage):
    key = "cpu A\nbuild 1"
    calibrate.calibrate(lib, key, tmp_path, measure=Flat())
    file = calibrate.cache_file(tmp_path, key)
    text = file.read_text()
    entry = json.loads(text)
    file.write_text({"truncated": text[: len(text) // 2], "not json": "\0\1garbage",
                     "another key": json.dumps(dict(entry, key="cpu Z")),
                     "bad candidate": json.dumps(dict(entry, chosen=dict(entry["chosen"],
                                                                         pack_b="maybe")))
                     }[damage])
    fake = Flat()
    with pytest.warns(RuntimeWarning) as caught:
        got = calibrate.calibrate(lib, key, tmp_path, measure=fake)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "\n" not in msg and str(file) in msg and "measuring again" in msg
    assert fake.calls > 0 and got.how.startswith("measured")
    assert json.loads(file.read_text())["key"] == key   # rewritten whole


def test_concurrent_first_uses_leave_one_whole_file(lib, tmp_path):
    # several threads calibrate into one empty folder at once (the processes' case is
    # test_load.py's concurrent build): each writes a whole file, renamed into place
    errors, results = [], []

    def run():
        try:
            results.append(calibrate.calibrate(lib, "cpu A\nbuild 1", tmp_path,
                                               measure=Flat()))
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    files = list(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".json"]
    assert json.loads(files[0].read_text())["key"] == "cpu A\nbuild 1"


def test_calibration_off_keeps_the_build_rules_and_a_bad_value_is_named(lib, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv(calibrate.CALIBRATION_ENV, "off")
    got = calibrate.calibrate(lib, "k", tmp_path, measure=Flat())
    assert got.chosen == calibrate._default_candidates(int(lib.dropless_vector_floats()))
    assert "off" in got.how and not list(tmp_path.iterdir())
    assert all(lib.dropless_setting(sid) == 0 for sid, _, _ in calibrate.SETTINGS.values())
    monkeypatch.setenv(calibrate.CALIBRATION_ENV, "sometimes")
    with pytest.raises(ValueError, match="DROPLESS_NATIVE_CALIBRATION='sometimes': use on or off"):
        calibrate.calibrate(lib, "k", tmp_path)
    with pytest.raises(ValueError, match="pack_b='maybe'"):
        with calibrate.use_settings(lib, pack_b="maybe"):
            pass


def test_describe_says_what_was_chosen_and_why():
    info = choice.describe()
    cal = load.calibration()
    assert info["native_choices"] == cal.chosen and set(cal.chosen) == set(calibrate.SETTINGS)
    assert info["native_calibration"] == cal.how


# every choice: B's panels packed or read in place, outputs streamed or stored, each form on
# either kernel. M = 1100 rows of N = 1040 (4.6 MB: above the 2-core streaming size of
# 2 x L2 on machines with L2 up to 2 MiB) in groups that leave partial tiles, a lone vector
# and a column past it (1040 = 16 x 65)
_CHOICES = list(itertools.product(["on", "off"], ["on", "off"], ["own", "openblas"]))


@pytest.fixture(scope="module")
def gemm_problem():
    sizes = [500, 0, 333, 260]
    m, k, n = sum(sizes) + 7, 72, 1040
    rng = np.random.default_rng(11)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((4, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    f64 = (lhs.astype(np.float64), rhs.astype(np.float64))
    want = (np_gmm(*f64, sizes), *np_gmm_grads(*f64, sizes, dy.astype(np.float64)))
    return (lhs, rhs, jnp.asarray(sizes, jnp.int32), dy), want, {}


@pytest.mark.parametrize("pack_b, stream, kernel", _CHOICES)
def test_every_choice_matches_float64_loop(fwd_bwd, lib, gemm_problem, pack_b, stream, kernel):
    args, want, seen = gemm_problem
    forms = dict.fromkeys(("kernel_nn", "kernel_nt", "kernel_tn", "kernel_gate_up"), kernel)
    with calibrate.use_settings(lib, pack_b=pack_b, stream=stream, **forms):
        got = tuple(map(np.asarray, jax.block_until_ready(fwd_bwd(*args))))
    m = args[0].shape[0]
    for a, b, scale in zip(got, want, (args[0].shape[1], args[1].shape[2], m)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.sqrt(scale))
    # on one kernel, how B is read and how C is stored change no arithmetic: bitwise the same
    first = seen.setdefault(kernel, got)
    for a, b in zip(got, first):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("pack_b, stream, kernel", _CHOICES)
def test_every_choice_of_the_fused_ffn_matches_float64_loop(lib, pack_b, stream, kernel):
    sizes = [700, 0, 450, 37]
    x, wg, wu, wd, dy = ffn_operands(m=1240, d=64, f=1040)
    gs = jnp.asarray(sizes, jnp.int32)
    forms = dict.fromkeys(("kernel_nn", "kernel_nt", "kernel_tn", "kernel_gate_up"), kernel)
    with calibrate.use_settings(lib, pack_b=pack_b, stream=stream, **forms):
        y, pullback = jax.vjp(lambda *a: ffn.swiglu_ffn(*a, gs), x, wg, wu, wd)
        got = jax.block_until_ready(pullback(dy))
    assert_matches_np_swiglu_ffn(y, got, x, wg, wu, wd, sizes, dy)

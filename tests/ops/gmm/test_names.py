"""The backend names the configs check without JAX (ops/gmm/names.py) are the registry's: the
built-in list is what the registry registers, in its order, and a name is checked the same way,
with the same message, before and after the registry loads; once it is loaded, a backend
registered since counts too. The checks without the registry run in a fresh interpreter (this
one has loaded it long ago)."""
import json
import subprocess
import sys
import textwrap

import pytest

from dropless.config import MoEConfig
from dropless.ops.gmm import aliases, names, registry
from dropless.ops.gmm.baselines import reference_gmm
from tests._support.paths import ROOT


def _fresh(code: str) -> dict:
    """What `code` (which prints one JSON line last) prints, run by this Python afresh."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _message(name: str) -> str:
    with pytest.raises(ValueError) as e:
        names.check_backend_name(name, where="MoEConfig.gmm_backend")
    return str(e.value)


def test_the_registry_registers_the_built_in_names_in_their_order():
    assert registry.grouped_matmul_backends() == ("auto",) + names.BACKENDS
    assert registry.check_backend_name is names.check_backend_name   # one check


def test_without_the_registry_the_names_and_the_message_are_the_same():
    seen = _fresh("""
        import json, sys
        from dropless.ops.gmm import names
        from dropless.config import MoEConfig
        try:
            MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, gmm_backend="fast")
        except ValueError as e:
            message = str(e)
        moe = MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, gmm_backend="tiled")
        print(json.dumps({"known": names.known_backends(), "message": message,
                          "backend": moe.gmm_backend,
                          "loaded": [m for m in ("jax", names.REGISTRY) if m in sys.modules]}))
        """)
    assert seen["loaded"] == []
    assert tuple(seen["known"]) == registry.grouped_matmul_backends()
    assert seen["message"] == _message("fast")
    assert seen["message"] == ("MoEConfig.gmm_backend='fast' is not a grouped-matmul backend; "
                               "known: auto, reference, ragged_dot, tiled, native, pallas_gpu, "
                               "tokamax, mosaic_gpu, cudnn_ragged_dot, padded, loop")
    assert seen["backend"] == "tiled"


def test_an_old_name_is_known_and_becomes_the_new_one(monkeypatch):
    names.check_backend_name("openblas")
    monkeypatch.setattr(aliases, "_WARNED", set())   # as in a fresh process
    with pytest.warns(DeprecationWarning, match="'openblas' is now called 'native'"):
        moe = MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, gmm_backend="openblas")
    assert moe.gmm_backend == "native"


def test_a_backend_registered_since_is_known_to_the_config():
    with pytest.raises(ValueError, match="'standin_names' is not a grouped-matmul backend"):
        names.check_backend_name("standin_names")
    with registry.stand_in("standin_names", reference_gmm, first_on="cpu"):
        assert names.known_backends()[-1] == "standin_names"
        moe = MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, gmm_backend="standin_names")
        assert moe.gmm_backend == "standin_names"
    assert "standin_names" not in names.known_backends()


@pytest.mark.parametrize("first", ["from dropless.ops.gmm import registry as r",
                                   "from dropless.ops.gmm import grouped_matmul_backends",
                                   "from dropless.ops import grouped_matmul"])
def test_every_backend_is_registered_however_the_registry_is_first_reached(first):
    """The packages above the registry load nothing (PEP 562); the registry registers the
    built-in backends itself, so reaching it by any path lists them all."""
    seen = _fresh(f"""
        import json, sys
        {first}
        from dropless.ops.gmm import registry
        print(json.dumps(registry.grouped_matmul_backends()))
        """)
    assert tuple(seen) == ("auto",) + names.BACKENDS

"""evaluate_batches: packed documents evaluated with their segment ids, positions and loss masks
give the training step's eval loss (the mean over every counted target; that a packed document
gives its logits alone is tests/models/test_deepseek_packing.py), padding rows count nothing."""
import jax
import numpy as np
import pytest

from dropless.config import ModelConfig, TrainConfig
from dropless.data.batch import Batch
from dropless.models import decoder
from dropless.models.evaluate import evaluate_batches, pad_rows
from dropless.train import step

CFG = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, d_ff=24,
                  attention="mha", num_kv_heads=1, head_dim=4)


def test_packed_documents_evaluate_as_the_step_does():
    params = decoder.init_params(jax.random.key(0), CFG)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 32, 6), rng.integers(0, 32, 5)   # two documents of 5 and 4 targets
    seg = np.int32([[1] * 5 + [2] * 4 + [0]])
    pos = np.int32([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
    packed = Batch(np.int32([[*a[:-1], *b[:-1], 0]]), np.int32([[*a[1:], *b[1:], 0]]), seg, pos,
                   np.float32([[1] * 9 + [0]]))
    got = evaluate_batches(CFG, params, [packed], rows=2)   # padded to 2 rows
    assert got["tokens"] == 9 and got["windows"] == 1
    ev = jax.jit(lambda p, b: step.eval_loss(p, b, cfg=TrainConfig(model=CFG)))(
        params, pad_rows(packed, 2))
    assert float(ev) == pytest.approx(got["loss"], rel=1e-6)
    with pytest.raises(ValueError, match="count no target"):
        evaluate_batches(CFG, params, [packed._replace(loss_mask_BS=np.zeros((1, 10),
                                                                            np.float32))],
                         rows=1)

"""The grouped-matmul shapes that matter: one table read by `bench gmm`, the GPU device check,
the `auto` winner table's buckets and the planner's calibration.

Legend: M routed rows, K contraction dim, N output dim, G groups (the experts one device holds),
D d_model, F an expert's hidden size.

Each model contributes the two grouped products of its expert FFN on one device: `gate_up`
([M, D] @ [G, D, 2F], the gate and up projections fused as the MoE layer runs them) and `down`
([M, F] @ [G, F, D]). A training step runs each product in three directions (`DIRECTIONS`):
`fwd` (x @ w per group), `dlhs` (dy @ w^T per group: M rows of [N] -> [K]) and `drhs` (x^T dy
per group: a [K, N] result for each of the G groups). Routings (`ROUTINGS`) draw the rows per
group from `group_sizes`, host-side and seeded, so every reader sees the same groups.

Rows per device (M) are the expected routed rows at the layout named: tokens a device x top-k,
spread over the experts the device holds (with expert parallelism every device receives, on
average, its share of every device's routed rows).
  - deepseek_v3_ep8: DeepSeek-V3 (D 7168, F 2048, 256 experts, top-8) at the published layout,
    EP 8 with 6 x 4096 tokens a device: 32 experts a device, 196,608 rows (~6k an expert)
    [DeepSeek-V3 technical report, arXiv:2412.19437, and its config.json].
  - qwen3_30b_a3b: Qwen3-30B-A3B (D 2048, F 768, 128 experts, top-8) on one GPU at 8 x 4096
    tokens: 262,144 rows (~2k an expert) [Qwen/Qwen3-30B-A3B config.json].
  - mixtral_8x7b: Mixtral 8x7B (D 4096, F 14336, 8 experts, top-2) at 2 x 4096 tokens a device:
    16,384 rows (~2k an expert) [mistralai/Mixtral-8x7B-v0.1 config.json].
  - small: the shape of the first device check (M 8192, K = N = 1024; G 8, 64, 256), kept for
    continuity with its records.
"""
from __future__ import annotations

import dataclasses

import numpy as np

DIRECTIONS = ("fwd", "dlhs", "drhs")
ROUTINGS = ("uniform", "zipf")
ROUTING_PATTERNS = ("uniform", "zipf", "half", "quarter_empty")


@dataclasses.dataclass(frozen=True)
class GmmShape:
    """One grouped product of the forward pass: `label` (model/product), the model it comes
    from, M, K, N, G (the forward's dims: lhs [M, K], rhs [G, K, N])."""
    label: str
    model: str
    m: int
    k: int
    n: int
    g: int

    def dims(self, direction: str) -> tuple[int, int, int]:
        """(M, K, N) of the product `direction` runs, as a grouped matmul over M rows sees it:
        dlhs contracts over N and yields K; drhs is K-grouped (its M is the contraction)."""
        if direction == "fwd":
            return self.m, self.k, self.n
        if direction == "dlhs":
            return self.m, self.n, self.k
        if direction == "drhs":
            return self.m, self.k, self.n
        raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")

    def flops(self) -> int:
        """Useful FLOPs of one direction: 2MKN, the same for all three."""
        return 2 * self.m * self.k * self.n


def _ffn(model: str, rows: int, d: int, f: int, g: int) -> tuple[GmmShape, GmmShape]:
    return (GmmShape(f"{model}/gate_up", model, rows, d, 2 * f, g),
            GmmShape(f"{model}/down", model, rows, f, d, g))


SHAPES: tuple[GmmShape, ...] = (
    *_ffn("deepseek_v3_ep8", 6 * 4096 * 8, 7168, 2048, 32),
    *_ffn("qwen3_30b_a3b", 8 * 4096 * 8, 2048, 768, 128),
    *_ffn("mixtral_8x7b", 2 * 4096 * 2, 4096, 14336, 8),
    GmmShape("small/G8", "small", 8192, 1024, 1024, 8),
    GmmShape("small/G64", "small", 8192, 1024, 1024, 64),
    GmmShape("small/G256", "small", 8192, 1024, 1024, 256),
)
MODELS = tuple(dict.fromkeys(s.model for s in SHAPES))


def shape(label: str) -> GmmShape:
    """The table's shape named `label`; ValueError naming the labels otherwise."""
    for s in SHAPES:
        if s.label == label:
            return s
    raise ValueError(f"no grouped-matmul shape {label!r}; the table has "
                     f"{', '.join(s.label for s in SHAPES)}")


def group_sizes(routing: str, m: int, g: int, seed: int = 0) -> np.ndarray:
    """Rows per group (int32, summing to m) for a named routing pattern, seeded: `uniform`
    (multinomial over equal shares), `zipf` (Zipf(1.2) shares over a random expert order),
    `half` (one expert takes half the rows), `quarter_empty` (a quarter of the experts get none)."""
    rng = np.random.default_rng(seed)
    if routing == "uniform":
        p = np.full(g, 1.0 / g)
    elif routing == "zipf":
        p = 1.0 / np.arange(1, g + 1) ** 1.2
        p = rng.permutation(p / p.sum())
    elif routing == "half":
        rest = np.full(g - 1, 0.5 / max(g - 1, 1))
        p = np.concatenate([[0.5], rest]) if g > 1 else np.ones(1)
    elif routing == "quarter_empty":
        p = np.ones(g)
        p[rng.permutation(g)[: g // 4]] = 0
        p /= p.sum()
    else:
        raise ValueError(f"routing={routing!r} is not one of {ROUTING_PATTERNS}")
    return rng.multinomial(m, p).astype(np.int32)

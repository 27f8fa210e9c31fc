"""The PyTorch peer of `dropless bench moe --vs-torch`: Hugging Face's Mixtral sparse MoE block
on `torch._grouped_mm`, the raw grouped matmuls alone, and a dense SwiGLU over the same rows.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, N = T*K routed rows.

torch is an optional extra of the bench (`pip install 'dropless[bench-torch]'`, CPU wheels from
https://download.pytorch.org/whl/cpu); this is the only module that imports it, and only when a
function here is called: without it, `require_torch` raises one ValueError naming the extra.

`mixtral_block` is transformers' code path, written out so the bench needs torch alone:
`MixtralTopKRouter.forward` (F.linear, float32 softmax, topk, renormalised) and
`integrations/moe.py:grouped_mm_experts_forward` (transformers 5.x, experts_implementation=
"grouped_mm": stable sort of the flat expert ids, gather `x[perm // K]`, histc + cumsum offsets,
`F.grouped_mm` (else `torch._grouped_mm`) on the stored [E, 2F, D] gate_up_proj transposed,
silu(gate) * up, the same on the stored [E, D, F] down_proj, routing weight, the inverse
permutation and a (T, K, D) sum). Its one addition: a selection bias added to the
probabilities before topk (zero on uniform routing, so exactly HF there), which is how the
dropless router takes the bench's Zipf skew; the weights stay the unbiased probabilities.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

EXTRA = "bench-torch"
INSTALL = (f"pip install 'dropless[{EXTRA}]' (CPU wheels: --extra-index-url "
           "https://download.pytorch.org/whl/cpu)")


def require_torch():
    """The torch module, with a grouped matmul; raises ValueError naming the extra otherwise."""
    try:
        import torch
    except ImportError:
        raise ValueError(f"dropless bench moe --vs-torch needs PyTorch, which is not installed: "
                         f"{INSTALL}") from None
    if grouped_mm_fn(torch) is None:
        raise ValueError(f"torch {torch.__version__} has no grouped matmul (torch._grouped_mm "
                         f"runs on CPU from torch 2.9): {INSTALL}")
    return torch


def grouped_mm_fn(torch) -> Callable | None:
    """What HF's `_grouped_mm` calls: torch.nn.functional.grouped_mm, else torch._grouped_mm."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def set_threads(torch, threads: int | None = None) -> int:
    """Give torch's intra-op pool the cores this process may use (XLA:CPU uses them all)."""
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return torch.get_num_threads()


def mixtral_weights(torch, params: dict[str, Any]) -> dict[str, Any]:
    """HF Mixtral's tensors from the dropless layer's parameters (numpy or jax arrays):
    router weight [E, D], gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F],
    and the selection bias [E]."""
    def t(a):
        return torch.from_numpy(np.array(a, np.float32, order="C", copy=True))
    ex = params["experts"]
    gate_up_ED2F = np.concatenate([np.asarray(ex["w_gate_EDF"]), np.asarray(ex["w_up_EDF"])], -1)
    return {"router_ED": t(np.asarray(params["router"]["w_DE"]).T),
            "gate_up_E2FD": t(gate_up_ED2F.transpose(0, 2, 1)),
            "down_EDF": t(np.asarray(ex["w_down_EFD"]).transpose(0, 2, 1)),
            "bias_E": t(params["router"]["bias_E"])}


def mixtral_block(torch, w: dict[str, Any], x_TD, top_k: int):
    """HF's MixtralSparseMoeBlock forward (grouped_mm experts) on x [T, D] -> [T, D]."""
    F = torch.nn.functional
    gmm = grouped_mm_fn(torch)
    num_experts = w["gate_up_E2FD"].shape[0]
    # MixtralTopKRouter.forward
    logits_TE = F.linear(x_TD, w["router_ED"])
    probs_TE = F.softmax(logits_TE.float(), dim=-1)
    ids_TK = torch.topk(probs_TE + w["bias_E"], top_k, dim=-1).indices
    top_TK = probs_TE.gather(1, ids_TK)
    weights_TK = (top_TK / top_TK.sum(dim=-1, keepdim=True)).to(x_TD.dtype)
    # grouped_mm_experts_forward
    t, d = x_TD.shape
    expert_ids_g, perm = torch.sort(ids_TK.reshape(-1))
    x_ND = x_TD[perm // top_k]
    w_N = weights_TK.reshape(-1)[perm]
    tokens_per_expert = torch.histc(expert_ids_g.float(), bins=num_experts, min=0,
                                    max=num_experts - 1)
    offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    gate_NF, up_NF = gmm(x_ND, w["gate_up_E2FD"].transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    h_NF = F.silu(gate_NF) * up_NF
    y_ND = gmm(h_NF, w["down_EDF"].transpose(-2, -1), offs=offs) * w_N.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    return y_ND[inv_perm].view(t, top_k, d).sum(dim=1).to(x_TD.dtype)


def grouped_ffn(torch, w_gate_up_ED2F, w_down_EFD, x_ND, offs_E):
    """The raw grouped path: SwiGLU per expert on expert-major rows, two `_grouped_mm` calls on
    contiguous [E, K, N] weights (no routing, no permutation)."""
    gmm = grouped_mm_fn(torch)
    gate_NF, up_NF = gmm(x_ND, w_gate_up_ED2F, offs=offs_E).chunk(2, dim=-1)
    return gmm(torch.nn.functional.silu(gate_NF) * up_NF, w_down_EFD, offs=offs_E)


def dense_swiglu(torch, w_gate_DF, w_up_DF, w_down_FD, x_ND):
    """The dense equivalent: one SwiGLU FFN of width F over all N routed rows."""
    h = torch.nn.functional.silu(x_ND @ w_gate_DF) * (x_ND @ w_up_DF)
    return h @ w_down_FD


def timed_fns(torch, params: dict[str, Any], x_TD: np.ndarray, dy_TD: np.ndarray,
              x_ND: np.ndarray, dy_ND: np.ndarray, group_sizes_E: np.ndarray, top_k: int,
              dtype: str = "float32"
              ) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """({name: forward}, {name: forward+backward}) zero-argument callables for the torch side:
    `torch/dense`, `torch/hf_mixtral` and `torch/grouped_mm`, every tensor in `dtype` (as a
    model loaded with `torch_dtype=dtype` holds them; the router's softmax stays float32, as
    HF's does). Forward runs under no_grad; forward+backward returns the output and the
    gradients of the input and of every weight."""
    as_dtype = getattr(torch, dtype)
    w = {name: v.to(as_dtype) for name, v in mixtral_weights(torch, params).items()}
    ex = params["experts"]
    tensor = lambda a: torch.from_numpy(np.array(a, np.float32, order="C", copy=True)).to(as_dtype)
    gu_ED2F = w["gate_up_E2FD"].transpose(-2, -1).contiguous()
    down_EFD = tensor(ex["w_down_EFD"])
    offs_E = torch.from_numpy(np.cumsum(group_sizes_E).astype(np.int32))
    dense_w = tuple(tensor(ex[name][0]) for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
    x, dy, xn, dyn = (tensor(a) for a in (x_TD, dy_TD, x_ND, dy_ND))
    block_w = {k: v for k, v in w.items() if k != "bias_E"}
    calls = {"torch/dense": (lambda *a: dense_swiglu(torch, *a), [*dense_w, xn], dyn),
             "torch/hf_mixtral": (lambda *a: mixtral_block(
                 torch, dict(zip(block_w, a[:-1]), bias_E=w["bias_E"]), a[-1], top_k),
                 [*block_w.values(), x], dy),
             "torch/grouped_mm": (lambda *a: grouped_ffn(torch, a[0], a[1], a[2], offs_E),
                                  [gu_ED2F, down_EFD, xn], dyn)}
    fwd, fwd_bwd = {}, {}
    for name, (fn, args, cot) in calls.items():
        leaves = [a.detach().clone().requires_grad_(True) for a in args]

        def forward(fn=fn, args=args):
            with torch.no_grad():
                return fn(*args)

        def forward_backward(fn=fn, leaves=leaves, cot=cot):
            out = fn(*leaves)
            return out, torch.autograd.grad(out, leaves, cot)
        fwd[name], fwd_bwd[name] = forward, forward_backward
    return fwd, fwd_bwd

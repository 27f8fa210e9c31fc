"""The EP transfers a chunked MoE layer hides behind its own grouped matmuls
(`MoEConfig.ep_comm_overlap_chunks = k`, moe/dispatch/overlap.py).

Legend: k chunks; per phase p (forward, backward, and the recomputed forward under remat
full/offload) n_p transfers (dispatch + combine, or their transposes), m_p one chunk's
transfers (n_p x the time of one dispatch of T/k tokens, latency included), c_p one chunk's
grouped matmuls (the phase's gmm time / k).

A phase is a two-resource pipeline: the link moves chunk i+1's dispatch and chunk i-1's
combine while the SMs run chunk i's matmuls. Its length is
    m_p + c_p + (k - 1) x max(c_p, m_p)
(the first chunk's transfers and the last one's matmuls cannot overlap: fill and drain), so
the communication it exposes beyond the matmuls is
    exposed_p = m_p + (k - 1) x max(0, m_p - c_p).
k = 1 exposes every transfer (m_p = all of them). More chunks hide more but pay one latency
per collective per chunk and pad every chunk's expert groups to a tile (plan/model.py's
padding at T/k tokens). Only the expert matmuls of the same layer hide the transfers here;
overlap="full" (other micro-batches' compute, Megatron's 1F1B A2A overlap) supersedes this.
"""
from __future__ import annotations

from dropless.machine import HardwareProfile
from dropless.plan import comm
from dropless.plan.layout import REMAT, PlanConfig, groups


def chunks(cfg: PlanConfig) -> int:
    """k: the chunks the trainer runs the MoE layer's tokens in (`PlanConfig.ep_chunks`: its
    `ep_comm_overlap_chunks` on a mesh; 1 for a dense model or one device)."""
    return cfg.ep_chunks


def transfer_time(cfg: PlanConfig, hw: HardwareProfile, num_chunks: int = 1) -> float:
    """Seconds of one dispatch (or combine) of one chunk of T/num_chunks tokens per device."""
    s, ep = cfg.model, cfg.mesh.expert
    if cfg.planned_dispatcher == "allgather":
        full = (cfg.micro_tokens_per_device / num_chunks * ep * s.d_model
                * cfg.activation_bytes)
        return comm.collective_time(full, groups(cfg, hw)["expert"], hw)
    nbytes = {k: v / num_chunks for k, v in comm.ep_bytes_per_transfer(cfg, hw).items()}
    return comm.a2a_time(nbytes, cfg, hw)


def _phases(cfg: PlanConfig) -> list[tuple[int, float]]:
    """(transfers, share of the layer's executed gmm FLOPs) per phase: forward 1 of 3 (+1 when
    the layer is recomputed), backward 2 of them, the recomputed forward 1."""
    if REMAT[cfg.run.remat].recomputes_layer:
        return [(2, 1 / 4), (2, 2 / 4), (2, 1 / 4)]
    return [(2, 1 / 3), (2, 2 / 3)]


def ep_pipeline(cfg: PlanConfig, hw: HardwareProfile, gmm_s: float) -> dict[str, float]:
    """One MoE layer's EP transfers chunked: `kernel_s` (all k chunks' transfers), `exposed_s`
    (what the pipeline leaves exposed beyond the layer's `gmm_s` seconds of grouped matmuls)
    and `hidden_s` (their difference)."""
    k = chunks(cfg)
    one = transfer_time(cfg, hw, k)
    kernel = exposed = 0.0
    for n, share in _phases(cfg):
        m, c = n * one, gmm_s * share / k
        kernel += k * m
        exposed += m + (k - 1) * max(0.0, m - c)
    return {"kernel_s": kernel, "exposed_s": exposed, "hidden_s": kernel - exposed}

"""A training batch as the loader hands it to the step.

Legend: B rows, S sequence length (inputs and targets are both S long).

Rows carry documents as `config.PACKINGS` says: `segment_ids_BS` numbers the documents of a row
from 1 (0 marks padding), `positions_BS` restarts at 0 with every document, and `loss_mask_BS` is
1 where the target counts (not padding, not a target in another document, not a prompt token
under `sft_completion_only`). Attention never crosses a segment boundary except under "stream".
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    tokens_BS: np.ndarray       # int32 inputs
    targets_BS: np.ndarray      # int32: the token after each input
    segment_ids_BS: np.ndarray  # int32: 1.. per document in the row, 0 = padding
    positions_BS: np.ndarray    # int32: position inside its document
    loss_mask_BS: np.ndarray    # float32: 1 where the target counts


def from_windows(windows_BS1: np.ndarray) -> Batch:
    """Rows of S + 1 stream tokens as one segment each (the "stream" packing): inputs are the
    first S tokens, targets the last S, positions 0..S-1, every target counted."""
    w = np.asarray(windows_BS1)
    b, s = w.shape[0], w.shape[1] - 1
    return Batch(tokens_BS=w[:, :-1].astype(np.int32), targets_BS=w[:, 1:].astype(np.int32),
                 segment_ids_BS=np.ones((b, s), np.int32),
                 positions_BS=np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
                 loss_mask_BS=np.ones((b, s), np.float32))

"""The pairing invariants of a preference build's rows (``packer verify``).

A row holds whole pairs: an even number of segments, roles 1, 0, 1, 0, ... (chosen, then rejected), both
segments of a pair from one record (one example id), and, unless ``--overlong truncate-left`` cut their
starts, the same prompt: the tokens before each segment's first trained one are equal. Cost: one pass over
the rows' small columns, and each pair's prompt tokens.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..contract import schema


def pair_problems(batch: pa.RecordBatch, *, left: bool = False) -> list[tuple[int, str]]:
    """(row in the batch, what is wrong) for every row that breaks a pairing invariant."""
    if schema.PAIR_COLUMN not in batch.schema.names:
        return [(0, f"no {schema.PAIR_COLUMN} column, which a preference build's rows have")]
    roles, seq_lens = batch.column(schema.PAIR_COLUMN), batch.column("seq_lens")
    ids = batch.column("input_ids")
    # format 1 stores labels (-100 where not trained), format 2 a loss mask: either says where training starts
    labels = batch.column("labels" if "labels" in batch.schema.names else schema.LOSS_MASK)
    examples = batch.column("example_ids")
    out = []
    for r in range(batch.num_rows):
        role = roles[r].values.to_numpy(zero_copy_only=False)
        lens = seq_lens[r].values.to_numpy(zero_copy_only=False).astype(np.int64)
        if role.size != lens.size or role.size % 2:
            out.append((r, f"{lens.size} segments and {role.size} roles: a row holds whole pairs (two segments each)"))
            continue
        if not ((role[0::2] == 1).all() and (role[1::2] == 0).all()):
            out.append((r, "pair roles are not chosen, rejected in turn (1, 0, 1, 0, ...)"))
        ex = examples[r].values.to_numpy(zero_copy_only=False)
        if (ex[0::2] != ex[1::2]).any():
            out.append((r, "a pair's two segments come from different records (example ids differ)"))
        if left:
            continue
        tok = ids[r].values.to_numpy(zero_copy_only=False)
        lab = labels[r].values.to_numpy(zero_copy_only=False)
        bounds = np.r_[0, np.cumsum(lens)]
        for k in range(0, lens.size, 2):
            a = slice(bounds[k], bounds[k + 1])
            b = slice(bounds[k + 1], bounds[k + 2])
            pa_ = _prompt(lab[a])
            pb = _prompt(lab[b])
            if pa_ != pb or not np.array_equal(tok[a][:pa_], tok[b][:pb]):
                out.append((r, f"pair {k // 2}: chosen and rejected do not share their prompt tokens"))
                break
    return out


def _prompt(labels: np.ndarray) -> int:
    """Tokens before the first trained one (the segment's first label is always -100, so from token 1)."""
    trained = np.flatnonzero(labels[1:] if labels.dtype == bool else labels[1:] != schema.IGNORE_INDEX)
    return int(trained[0]) + 1 if trained.size else labels.size

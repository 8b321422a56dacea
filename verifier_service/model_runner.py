"""Runs one scheduled step on the target: applies copy-on-write block copies, packs every scheduled sequence
into one flattened forward batch, runs the paged model and turns the verification rows' logits into tokens.

A token tree's nodes are fed after the last verified token, cached at the indices that follow it in node order
(scratch slots within the sequence's own blocks), at the positions of their depths, each seeing the prefix and
its ancestors (kernels.paged_attention). After the verdict the accepted path's K and V move to the positions they
now hold; what lies past them is never read again (the scheduler truncates the sequence's blocks to its cached
tokens)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.block_manager import BlockManager
from common.paged_model import ForwardBatch, PagedCausalLM
from common.static_forward import StaticForward
from kernels.paged_attention import TreeMask
from verifier_service.types import ScheduledSeq, SchedulerOutput
from verifier_service.verification import Verification, Verified, pack_host, verify_batch


@dataclass(frozen=True)
class RunnerOutput:
    # per verification, in schedule order: accepted drafts then the recovered/bonus token; None: non-finite logits
    sampled: list[list[int] | None]
    num_tokens: int  # tokens fed
    forward_s: float  # preparation, copies and the forward pass
    sample_s: float  # verification: probabilities, rejection sampling, the copy of the tokens back
    host_s: float  # the host's share before any device work: block copies queued, batch and inputs packed
    device_s: float | None = None  # on a GPU: the device's time from the forward's first kernel to the tokens
    static: bool = False  # the forward ran through the static buffers (a graph replay with graphs on)


class VerifierRunner:
    def __init__(self, model: PagedCausalLM, blocks: BlockManager, static: StaticForward | None = None) -> None:
        """static: decode-sized steps go through its static device buffers (and graphs); others, and every step
        without it, through the model's forward."""
        self.model = model
        self.blocks = blocks
        self.static = static
        self._timed = model.device.type == "cuda"

    def run(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        if out.block_copies:
            self.model.kv_cache.copy_blocks(out.block_copies)
        batch, items = self.prepare_inputs(out)
        host_inputs = pack_host(items) if items else None
        host_s = time.perf_counter() - t0
        static = self.static is not None and self.static.eligible(batch)
        if self._timed:  # events on the stream: the device's own time, read after the tokens came back
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if static:  # the verification's inputs travel with the batch: one host-to-device copy for the step
            logits, flat = self.static.run(batch, host_inputs.flat if host_inputs else None)
            inputs = host_inputs.on_device(flat) if host_inputs else None
        else:
            logits = self.model.forward(batch)  # [num_draft_tokens + batch, vocab]
            inputs = host_inputs.to(logits.device) if host_inputs else None
        t1 = time.perf_counter()
        verified = verify_batch(logits, items, inputs) if items else []
        self._keep_accepted_paths(out.verifications, verified)
        sampled = [v.token_ids if v is not None else None for v in verified]
        device_s = None
        if self._timed:
            end.record()
            end.synchronize()
            device_s = start.elapsed_time(end) / 1e3
        return RunnerOutput(sampled, batch.input_ids.numel(), t1 - t0, time.perf_counter() - t1, host_s, device_s,
                            static)

    def _keep_accepted_paths(self, scheduled: list[ScheduledSeq], verified: list[Verified | None]) -> None:
        """Move each tree's accepted nodes' K and V from their scratch slots to the positions they now hold, in
        every layer at once (a node at depth d sits at index d or later, so no move overwrites another's source)."""
        moves: list[tuple[int, int]] = []
        for item, v in zip(scheduled, verified, strict=True):
            if v is None or item.proposal.draft_parents is None:
                continue
            first = item.seq.num_tokens  # node 0's index, and the accepted path's first position
            for depth, node in enumerate(v.path):
                if node != depth:
                    source, = self.blocks.slots(item.seq.key, first + node, first + node + 1)
                    dest, = self.blocks.slots(item.seq.key, first + depth, first + depth + 1)
                    moves.append((source, dest))
        if moves:
            self.model.kv_cache.copy_slots(moves)

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[Verification]]:
        """One flattened variable-length batch; logits only for each verification's [last, drafts] rows."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        items: list[Verification] = []
        trees = any(item.proposal is not None and item.proposal.draft_parents is not None for item in out.scheduled)
        tree_starts: list[int] = []
        tree_masks: list[int] = []
        for item in out.scheduled:
            seq = item.seq
            input_ids.extend(item.token_ids)
            tree = item.proposal.draft_parents is not None if item.proposal is not None else False
            if tree:  # the verified tokens fed, then the nodes at the positions of their depths
                positions.extend(range(item.start, seq.num_tokens))
                positions.extend(seq.num_tokens + d for d in item.proposal.depths)
            else:
                positions.extend(range(item.start, item.end))
            if trees:
                tree_starts.append(seq.num_tokens if tree else item.end)
                tree_masks.extend([-1] * (seq.num_tokens - item.start) + item.proposal.ancestor_masks() if tree
                                  else [-1] * item.num_tokens)
            slots.extend(self.blocks.slots(seq.key, item.start, item.end))
            query_start.append(query_start[-1] + item.num_tokens)
            if item.proposal is not None:
                k = item.proposal.num_draft_tokens
                logits_rows.extend(range(query_start[-1] - k - 1, query_start[-1]))
                items.append((seq.sampling, item.proposal))
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start=query_start,
            context_lens=[item.end for item in out.scheduled],
            block_tables=[self.blocks.table(item.seq.key) for item in out.scheduled],
            # every row wanted (a decode-sized step: verification blocks only): None, so it may run static
            logits_indices=None if len(logits_rows) == len(input_ids) else torch.tensor(logits_rows,
                                                                                          dtype=torch.int64),
            tree=TreeMask(torch.tensor(tree_starts, dtype=torch.int32), torch.tensor(tree_masks, dtype=torch.int64),
                          torch.tensor(positions, dtype=torch.int64)) if trees else None,
        )
        return batch, items

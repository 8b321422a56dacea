"""Runs one scheduled step on the target: applies copy-on-write block copies, packs every scheduled sequence
into one flattened forward batch, runs the paged model and turns the verification rows' logits into tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.block_manager import BlockManager
from common.paged_model import ForwardBatch, PagedCausalLM
from common.static_forward import StaticForward
from verifier_service.types import SchedulerOutput
from verifier_service.verification import Verification, pack_host, verify_batch


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
        sampled = verify_batch(logits, items, inputs) if items else []
        device_s = None
        if self._timed:
            end.record()
            end.synchronize()
            device_s = start.elapsed_time(end) / 1e3
        return RunnerOutput(sampled, batch.input_ids.numel(), t1 - t0, time.perf_counter() - t1, host_s, device_s,
                            static)

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[Verification]]:
        """One flattened variable-length batch; logits only for each verification's [last, drafts] rows."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        items: list[Verification] = []
        for item in out.scheduled:
            seq = item.seq
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start, item.end))
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
        )
        return batch, items

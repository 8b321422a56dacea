"""Runs one scheduled step on the target: applies copy-on-write block copies, packs every scheduled sequence
into one flattened forward batch, runs the paged model and turns the verification rows' logits into tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.block_manager import BlockManager
from common.paged_model import ForwardBatch, PagedCausalLM
from verifier_service.scheduler import SchedulerOutput
from verifier_service.verification import VerifyItem, verify_batch


@dataclass(frozen=True)
class RunnerOutput:
    # per verification, in schedule order: accepted drafts then the recovered/bonus token; None: non-finite logits
    sampled: list[list[int] | None]
    num_tokens: int  # tokens fed
    forward_s: float  # preparation, copies and the forward pass
    sample_s: float  # verification: probabilities, rejection sampling, the copy of the tokens back
    host_s: float  # the host's share before any device work: block copies queued, batch built on the host


class VerifierRunner:
    def __init__(self, model: PagedCausalLM, blocks: BlockManager) -> None:
        self.model = model
        self.blocks = blocks

    def run(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        if out.block_copies:
            self.model.kv_cache.copy_blocks(out.block_copies)
        batch, items = self.prepare_inputs(out)
        host_s = time.perf_counter() - t0
        logits = self.model.forward(batch)  # [num_draft_tokens + num_verifications, vocab_size]
        t1 = time.perf_counter()
        sampled = verify_batch(logits, items) if items else []
        return RunnerOutput(sampled, batch.input_ids.numel(), t1 - t0, time.perf_counter() - t1, host_s)

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[VerifyItem]]:
        """One flattened variable-length batch; logits only for each verification's [last, drafts] rows."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        items: list[VerifyItem] = []
        for item in out.scheduled:
            seq = item.seq
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start, item.end))
            slots.extend(self.blocks.slots(seq.key, item.start, item.end))
            query_start.append(query_start[-1] + item.num_tokens)
            if item.proposal is not None:
                k = item.proposal.num_draft_tokens
                logits_rows.extend(range(query_start[-1] - k - 1, query_start[-1]))
                items.append(VerifyItem(seq.sampling, seq.num_tokens, item.proposal.draft_token_ids,
                                        item.proposal.draft_probs))  # coupled sequences send no draft_probs
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start=query_start,
            context_lens=[item.end for item in out.scheduled],
            block_tables=[self.blocks.table(item.seq.key) for item in out.scheduled],
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        )
        return batch, items

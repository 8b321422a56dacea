"""Decode-sized forward passes through static device buffers, replayable as CUDA/HIP graphs.

A verification step of B sequences feeds each its k_i + 1 tokens and needs logits for every one of them; a draft
step feeds each sequence one token. Such a step is *static-eligible* when every token's logits are wanted, every
sequence's query fits one attention tile (k + 1 <= 16 rows) and the step has at most `max_tokens` tokens. Its
inputs are then written into one pinned host buffer and moved with one host-to-device copy into buffers at fixed
device addresses: token ids, positions, KV slots, query starts, context lengths and block tables. The forward reads
nothing else from the host.

Without graphs the step runs eagerly over exactly its tokens. With graphs (`--cuda-graphs`), the hidden-state
pass for each size bucket (1, 2, 4, 8, then multiples of 16 up to `max_tokens`) is captured once at start-up and
replayed; a step is padded to its bucket with tokens that write no KV (slot -1) and sequences with an empty query,
so every launch a graph recorded, grids included, fits any step of that bucket. The final norm and lm_head run
eagerly on the step's own rows: one output buffer of [max_tokens, hidden] serves every graph, where captured
logits would hold a [bucket, vocab] buffer per graph.

Other steps (prefill chunks, long blocks) take the model's ordinary forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from common.paged_model import ForwardBatch, PagedCausalLM
from kernels import platform
from kernels.paged_attention import AttentionMetadata

log = structlog.get_logger(__name__)

PAD_SLOT = -1


def graph_sizes(max_tokens: int) -> list[int]:
    """The captured token counts: 1, 2, 4, 8, then multiples of 16 up to max_tokens (which is always one)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_tokens] + list(range(16, max_tokens, 16))
    return [*sizes, max_tokens]


@dataclass(frozen=True)
class _Layout:
    """Offsets of the int32 staging buffer: ids, positions, slots [T]; query_start [T + 1]; context_lens [T];
    block tables [T, W] last, so a step copies only the rows it uses."""

    max_tokens: int
    width: int  # block table row: max blocks per sequence

    @property
    def ids(self) -> int:
        return 0

    @property
    def positions(self) -> int:
        return self.max_tokens

    @property
    def slots(self) -> int:
        return 2 * self.max_tokens

    @property
    def query_start(self) -> int:
        return 3 * self.max_tokens

    @property
    def context_lens(self) -> int:
        return 4 * self.max_tokens + 1

    @property
    def tables(self) -> int:
        return 5 * self.max_tokens + 1

    def size(self, rows: int) -> int:
        return self.tables + rows * self.width


class StaticForward:
    def __init__(self, model: PagedCausalLM, *, max_tokens: int, max_blocks_per_seq: int,
                 graphs: bool = False) -> None:
        """max_tokens: the largest static step (and, with graphs, the largest captured bucket);
        max_blocks_per_seq: a block table row, enough for the longest sequence (max_model_len / block_size)."""
        if graphs and model.device.type != "cuda":
            raise ValueError(f"--cuda-graphs needs a GPU; this service runs on {model.device.type} (use --device "
                             "cuda, or drop --cuda-graphs)")
        if not platform.use_triton(model.embed_tokens.weight):
            raise ValueError("static buffers feed the Triton kernels: a GPU, or SPECWIRE_KERNELS=triton on CPU")
        if max_tokens < 1 or max_blocks_per_seq < 1:
            raise ValueError(f"max_tokens and max_blocks_per_seq must be >= 1, got {max_tokens}, "
                             f"{max_blocks_per_seq}")
        self.model = model
        self.device = model.device
        self.layout = _Layout(max_tokens, max_blocks_per_seq)
        self.max_query_len = platform.ATTENTION_TILES.block_m  # one query tile per sequence
        pin = self.device.type == "cuda"
        self._staging = torch.zeros(self.layout.size(max_tokens), dtype=torch.int32, pin_memory=pin)
        self._host = self._staging.numpy()
        self._buffer = torch.zeros(self.layout.size(max_tokens), dtype=torch.int32, device=self.device)
        self._hidden = torch.empty((max_tokens, model.model.config.hidden_size), dtype=model.model.dtype,
                                   device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the last copy out of the staging buffer: the next step waits for it before writing there
        self._copied = torch.cuda.Event() if pin else None
        self.num_static_steps = 0
        self.num_replays = 0
        if graphs:
            self.capture()

    @property
    def max_tokens(self) -> int:
        return self.layout.max_tokens

    def eligible(self, batch: ForwardBatch) -> bool:
        return (batch.logits_indices is None and batch.attention is None and batch.tree is None
                and 0 < batch.input_ids.numel() <= self.max_tokens
                and batch.max_query_len <= self.max_query_len
                and max(len(t) for t in batch.block_tables) <= self.layout.width)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [num_logits, vocab_size]
        """Any batch: the static path when it is eligible, the model's ordinary forward otherwise."""
        return self.run(batch)[0] if self.eligible(batch) else self.model.forward(batch)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, payload: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An eligible batch (the caller checked `eligible`) through the static path: the logits, and `payload`
        (int64, the step's other inputs: the verification's) on the device. The payload rides in the same
        host-to-device copy as the batch, in the block-table rows the step leaves unused; when it does not fit
        there, it takes a copy of its own."""
        num_tokens = batch.input_ids.numel()
        size = self._bucket(num_tokens) if self.graphs else num_tokens
        on_device = self._load(batch, size, payload)
        self.num_static_steps += 1
        if self.graphs:
            self.graphs[size].replay()
            self.num_replays += 1
            normed = self._hidden[:num_tokens]
        else:
            normed = self.model.norm(self.model.hidden_states(self._views(len(batch.block_tables), num_tokens)))
        return self.model.logits(normed), on_device

    def _bucket(self, num_tokens: int) -> int:
        return next(s for s in sorted(self.graphs) if s >= num_tokens)

    def _load(self, batch: ForwardBatch, size: int, payload: np.ndarray | None = None) -> torch.Tensor | None:
        """Writes the step into the staging buffer, padded to `size` tokens and sequences (a graph's bucket),
        with `payload` after the block-table rows it uses, and copies it all to the device in one copy. Returns
        the payload's device view. Padding sequences never read their table rows, so the payload may sit there."""
        lay, host = self.layout, self._host
        n, num_seqs = batch.input_ids.numel(), len(batch.block_tables)
        if self._copied is not None:
            self._copied.synchronize()  # already done in practice: every step reads its results back
        host[lay.ids:lay.ids + n] = batch.input_ids.numpy()
        host[lay.positions:lay.positions + n] = batch.positions.numpy()
        host[lay.slots:lay.slots + n] = batch.slot_mapping.numpy()
        host[lay.slots + n:lay.slots + size] = PAD_SLOT  # padding tokens write no KV
        host[lay.query_start:lay.query_start + num_seqs + 1] = batch.query_start
        host[lay.query_start + num_seqs + 1:lay.query_start + size + 1] = n  # padding sequences: empty queries
        host[lay.context_lens:lay.context_lens + num_seqs] = batch.context_lens
        host[lay.context_lens + num_seqs:lay.context_lens + size] = 0
        tables = host[lay.tables:lay.size(num_seqs)].reshape(num_seqs, lay.width)
        for row, table in zip(tables, batch.block_tables, strict=True):
            row[:len(table)] = table  # entries past a sequence's blocks are never read
        used = lay.size(num_seqs)
        start = used + used % 2  # int64 alignment
        inline = payload is not None and start + 2 * payload.size <= host.size
        if inline:
            host[start:start + 2 * payload.size] = payload.view(np.int32)
            used = start + 2 * payload.size
        self._buffer[:used].copy_(self._staging[:used], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if payload is None:
            return None
        if not inline:
            return torch.from_numpy(payload).to(self.device)
        return self._buffer[start:used].view(torch.int64)

    def _views(self, num_seqs: int, num_tokens: int) -> ForwardBatch:
        """The static batch: `num_seqs` sequence slots over `num_tokens` tokens, as views of the device buffer."""
        lay, buf = self.layout, self._buffer
        meta = AttentionMetadata(
            block_tables=buf[lay.tables:lay.size(num_seqs)].view(num_seqs, lay.width),
            query_start=buf[lay.query_start:lay.query_start + num_seqs + 1],
            context_lens=buf[lay.context_lens:lay.context_lens + num_seqs],
            max_query_len=self.max_query_len,
        )
        return ForwardBatch(buf[lay.ids:lay.ids + num_tokens], buf[lay.positions:lay.positions + num_tokens],
                            buf[lay.slots:lay.slots + num_tokens], [], [], [], None, meta)

    def capture(self) -> None:
        """One graph per bucket, largest first, in one memory pool. Each bucket runs twice eagerly first (Triton
        compiles, cuBLAS picks its kernels) on padding only: every slot -1 and every query empty, so nothing is
        written to the KV pool."""
        t0 = time.perf_counter()
        lay, host = self.layout, self._host
        host[lay.slots:lay.slots + self.max_tokens] = PAD_SLOT
        host[lay.query_start:lay.query_start + self.max_tokens + 1] = 0
        host[lay.context_lens:lay.context_lens + self.max_tokens] = 0
        self._buffer.copy_(self._staging)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        with torch.inference_mode():
            for size in sorted(graph_sizes(self.max_tokens), reverse=True):
                static = self._views(size, size)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._hidden[:size].copy_(self.model.norm(self.model.hidden_states(static)))
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._hidden[:size].copy_(self.model.norm(self.model.hidden_states(static)))
                self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("graphs_captured", sizes=len(self.graphs), max_tokens=self.max_tokens,
                 seconds=round(time.perf_counter() - t0, 2),
                 memory_bytes=max(0, free_before - torch.cuda.mem_get_info(self.device)[0]))


def graphs_by_default(device: torch.device, model_impl: str, *, hip: bool, triton: bool) -> bool:
    """--cuda-graphs left unset: graphs on a CUDA GPU with the native implementation and the Triton kernels. The
    GPU check captured and replayed them on an H200 (the replay's logits and KV equal to the eager step's, the
    end-to-end tests passed with them) and a 7B-shaped verification step took 9 ms replayed against 31 ms eager at
    batch 1. Off on ROCm, where no HIP GPU has run a capture yet, on the CPU, on the transformers backend (which
    refuses them) and under SPECWIRE_KERNELS=reference (the static buffers feed the Triton kernels)."""
    return device.type == "cuda" and not hip and triton and model_impl != "transformers"


def build_static_forward(model: PagedCausalLM, *, max_tokens: int, max_model_len: int, block_size: int,
                         graphs: bool | None) -> StaticForward | None:
    """The static path where the Triton kernels run (a GPU, or SPECWIRE_KERNELS=triton); None on the CPU's
    torch path, whose attention reads host lists. Graphs asked for without a GPU are a clear error (raised by
    StaticForward); None (the flag unset) chooses by graphs_by_default, and a capture that fails then (out of
    memory, say) leaves the service on the static buffers without graphs, where one asked for stops it."""
    chosen = graphs is None
    if chosen:
        graphs = graphs_by_default(model.device, getattr(model, "model_impl", "native"), hip=platform.is_rocm(),
                                   triton=platform.use_triton(model.embed_tokens.weight))
    if not graphs and not platform.use_triton(model.embed_tokens.weight):
        return None
    if getattr(model, "model_impl", "native") == "transformers":
        if graphs:
            raise ValueError("--cuda-graphs is not supported on the transformers backend (--model-impl "
                             "transformers): its forward is transformers' own, which for MoE layers routes tokens "
                             "with data-dependent shapes and host synchronisation that a graph cannot capture, and "
                             "no GPU has proven a capture of it; its decode-sized steps still run through the "
                             "static buffers without graphs")
        if not model.supports_static:
            log.info("static_forward", enabled=False, reason="the model's logits are not lm_head over its decoder "
                     "output (a logit transform specwire does not know): every step takes the full forward")
            return None
    static = StaticForward(model, max_tokens=max_tokens, max_blocks_per_seq=-(-max_model_len // block_size),
                           graphs=bool(graphs) and not chosen)
    if graphs and chosen:
        try:
            static.capture()
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            static.graphs.clear()
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
                torch.cuda.empty_cache()
            log.warning("graphs_not_captured", error=str(err)[:300], fallback="static buffers without graphs; "
                        "--cuda-graphs false skips the capture, --cuda-graphs true makes its failure stop the service")
            graphs = False
    log.info("static_forward", max_tokens=max_tokens, graphs=sorted(static.graphs) if graphs else None,
             graphs_by_default=chosen)
    return static

"""The model runner: per-step inputs and metadata, one attention plan per step, the forward
pass, CUDA-graph decode, sampling.

Decode batches (one new token per sequence) on CUDA replay a graph captured for the smallest
batch-size bucket that holds them (``EngineConfig.cuda_graph_sizes``). The graphs read static
input buffers; each step writes its inputs there, pads the rest of the bucket (no query
tokens, no cache writes), re-plans the persistent path in place with ``plan.update()`` and
replays. Everything else (prefill, extend, mixed batches, the CPU) runs eagerly with a fresh
``plan_attention`` per step.
"""

from __future__ import annotations

import torch

from pagedattn.engine.attention import StepMetadata, make_backend
from pagedattn.engine.config import EngineConfig, ModelConfig
from pagedattn.engine.sampler import Sampler
from pagedattn.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, mcfg: ModelConfig, ecfg: EngineConfig):
        self.model, self.mcfg, self.ecfg = model, mcfg, ecfg
        self.device, self.dtype = model.device, model.dtype
        model.rotary.build(ecfg.max_model_len)
        self.attn = make_backend(mcfg, ecfg, device=self.device, dtype=self.dtype)
        self.sampler = Sampler(self.device, ecfg.seed)
        self.pages_per_seq = -(-ecfg.max_model_len // ecfg.block_size)
        self.padding_row = ecfg.max_num_seqs
        self.graphs: dict = {}  # bucket size -> replay() returning the bucket's logits
        self.graph_note = "eager (CPU)" if self.device.type != "cuda" else "eager (enforce_eager)"
        self.time_forward = False
        self.last_forward_ms = None
        self.last_used_graph = False
        if self.device.type == "cuda" and not ecfg.enforce_eager and ecfg.cuda_graph_sizes:
            self.capture_graphs()

    # ---- inputs ---------------------------------------------------------------------------
    def _slots(self, seq, start: int, n: int) -> list[int]:
        bs, table = self.ecfg.block_size, seq.block_table
        if n == 1:
            return [table[start // bs] * bs + start % bs]
        pos = torch.arange(start, start + n)
        return (torch.tensor(table)[pos // bs] * bs + pos % bs).tolist()

    def _table(self, seqs) -> torch.Tensor:
        """``[len(seqs), max pages]`` int32 block table (zeros past a sequence's pages and for None)."""
        tables = [s.block_table if s is not None else [] for s in seqs]
        width = max([len(t) for t in tables] + [1])
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def _eager_inputs(self, batch: ScheduledBatch):
        ids, pos, slots, rows, qsl, lens = [], [], [], [], [0], []
        for seq, n in zip(batch.seqs, batch.num_new):
            start = seq.num_computed
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += self._slots(seq, start, n)
            rows += [seq.slot] * n
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
        return ids, pos, slots, rows, qsl, lens, self._table(batch.seqs)

    def _decode_inputs(self, layout: list, size: int):
        """Host inputs of a decode batch in ``layout`` order (None: padding), padded to ``size`` rows."""
        ids, pos, slots = [0] * size, [0] * size, [-1] * size
        rows, lens, qsl = [self.padding_row] * size, [1] * size, [0] * (size + 1)
        for r, seq in enumerate(layout):
            if seq is not None:
                p = seq.num_computed
                ids[r], pos[r], rows[r], lens[r] = seq.token_ids[p], p, seq.slot, p + 1
                slots[r] = self._slots(seq, p, 1)[0]
            qsl[r + 1] = qsl[r] + (seq is not None)
        for r in range(len(layout), size):
            qsl[r + 1] = qsl[r]
        return ids, pos, slots, rows, qsl, lens, self._table(layout + [None] * (size - len(layout)))

    def _metadata(self, host, *, plan, decode_rows: int = 0):
        ids, pos, slots, rows, qsl, lens, table = host
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        meta = StepMetadata(
            positions=t(pos, torch.int64), query_start_loc=t(qsl, torch.int32), seq_lens=t(lens, torch.int32),
            block_table=table.to(dev, non_blocking=True), slot_mapping=t(slots, torch.int64),
            cache_rows=t(rows, torch.int64), plan=plan, host_query_start_loc=qsl, host_seq_lens=lens,
            host_rows=[rows[a] for a in qsl[:-1]] if not decode_rows else rows, decode_rows=decode_rows,
        )
        return t(ids, torch.int64), meta

    # ---- forward --------------------------------------------------------------------------
    def _forward(self, input_ids, meta, select=None) -> torch.Tensor:
        self.attn.prepare(meta)
        hidden = self.model(input_ids, meta.positions, self.attn, meta)
        if select is not None:
            hidden = hidden[select]
        return self.model.logits(hidden)

    def _timed(self, fn):
        """``fn()``; when ``time_forward`` is on (CUDA), its GPU time, from after the step's inputs
        were enqueued, goes to ``last_forward_ms``."""
        if not (self.time_forward and self.device.type == "cuda"):
            return fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        self.last_forward_ms = start.elapsed_time(end)
        return out

    def forward(self, batch: ScheduledBatch, *, all_tokens: bool = False) -> torch.Tensor:
        """Logits ``[n, vocab]`` fp32: of each sampling sequence's last token in batch order, or
        (``all_tokens``) of every token of the batch."""
        self.last_used_graph = False
        self.last_forward_ms = None
        if batch.is_decode and not all_tokens:
            return self._decode(batch).float()
        host = self._eager_inputs(batch)
        ids, meta = self._metadata(host, plan=self.attn.step_plan(host[4], host[5]))
        select = None
        if not all_tokens:
            select = torch.tensor([host[4][i + 1] - 1 for i in range(len(batch.seqs)) if batch.samples(i)],
                                  dtype=torch.int64).to(self.device)
        return self._timed(lambda: self._forward(ids, meta, select)).float()

    def _decode(self, batch: ScheduledBatch) -> torch.Tensor:
        layout = self.attn.decode_layout(batch.seqs)
        row_of = {id(s): r for r, s in enumerate(layout) if s is not None}
        select = [row_of[id(s)] for s in batch.seqs]
        bucket = min((b for b in self.graphs if b >= len(layout)), default=None)
        if bucket is None:
            host = self._decode_inputs(layout, len(layout))
            ids, meta = self._metadata(host, plan=self.attn.step_plan(host[4], host[5]), decode_rows=len(layout))
            select = torch.tensor(select, dtype=torch.int64).to(self.device)
            return self._timed(lambda: self._forward(ids, meta, select))
        ids, pos, slots, rows, qsl, lens, table = self._decode_inputs(layout, bucket)
        s = self.static
        for name, values, dtype in (("input_ids", ids, torch.int64), ("positions", pos, torch.int64),
                                    ("slot_mapping", slots, torch.int64), ("cache_rows", rows, torch.int64),
                                    ("seq_lens", lens, torch.int32), ("query_start_loc", qsl, torch.int32)):
            s[name][:len(values)].copy_(torch.tensor(values, dtype=dtype), non_blocking=True)
        s["block_table"][:bucket, :table.shape[1]].copy_(table, non_blocking=True)
        n = len(layout)
        self.attn.update_graph_plan(self.graph_plan, qsl[:n + 1], lens[:n])
        logits = self._timed(self.graphs[bucket])
        self.last_used_graph = True
        return logits[select]

    def execute(self, batch: ScheduledBatch) -> list[int]:
        """Run one step and return the sampled token of each sequence that samples, in batch order."""
        temps = [seq.params.temperature for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        if not temps:
            self.forward(batch)
            return []
        return self.sampler(self.forward(batch), temps)

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _graph_forward(self, size: int) -> torch.Tensor:
        s = self.static
        meta = StepMetadata(
            positions=s["positions"][:size], query_start_loc=s["query_start_loc"][:size + 1],
            seq_lens=s["seq_lens"][:size], block_table=s["block_table"][:size], slot_mapping=s["slot_mapping"][:size],
            cache_rows=s["cache_rows"][:size], plan=self.graph_plan, decode_rows=size,
        )
        return self._forward(s["input_ids"][:size], meta)

    @torch.inference_mode()
    def capture_graphs(self, *, emulate: bool = False) -> None:
        """Capture one decode graph per bucket, largest first, sharing one memory pool. A failure
        leaves the runner eager and says why in ``graph_note``.

        ``emulate``: no capture; a "replay" runs the same forward over the static buffers (what
        the CPU tests use to check the buffers, the padding and the plan updates of graph decode).
        """
        sizes = sorted(self.ecfg.cuda_graph_sizes, reverse=True)
        top, dev = sizes[0], self.device
        self.static = {
            "input_ids": torch.zeros(top, dtype=torch.int64, device=dev),
            "positions": torch.zeros(top, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((top,), -1, dtype=torch.int64, device=dev),
            "cache_rows": torch.full((top,), self.padding_row, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(top, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(top + 1, dtype=torch.int32, device=dev),
            "block_table": torch.zeros(top, self.pages_per_seq, dtype=torch.int32, device=dev),
        }
        self.graph_plan = self.attn.graph_plan(top)
        self.graphs = {}
        if emulate:
            self.graphs = {size: (lambda size=size: self._graph_forward(size)) for size in sizes}
            self.graph_note = f"emulated decode graphs for batch sizes {sorted(self.graphs)}"
            return
        pool = None
        try:
            for size in sizes:
                self.attn.update_graph_plan(self.graph_plan, list(range(size + 1)), [1] * size)
                self._graph_forward(size)  # compiles and autotunes outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._graph_forward(size)
                pool = graph.pool()
                self.graphs[size] = self._replayer(graph, logits)
            self.graph_note = f"decode CUDA graphs for batch sizes {sorted(self.graphs)}"
        except Exception as e:  # noqa: BLE001 - run eagerly and report why
            torch.cuda.synchronize()
            self.graphs = {}
            self.graph_note = f"eager decode (graph capture failed: {type(e).__name__}: {str(e)[:200]})"

    @staticmethod
    def _replayer(graph, logits):
        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

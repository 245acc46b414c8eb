"""Next-token sampling per sequence: repetition penalty, greedy, temperature with top-k / top-p /
min-p, and per-request seeds."""

from __future__ import annotations

import torch


class Sampler:
    """Chooses one token per row of a step's logits, each row with its sequence's parameters.

    A draw is the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` per vocabulary entry: it
    picks token i with probability ``p_i``, and the noise comes from the sequence's own
    generator when its request has a ``seed`` (so its tokens do not depend on which other
    requests share the step), else from the engine's generator (seeded by ``EngineConfig.seed``).
    Steps whose rows are all greedy without a penalty cost one argmax.
    """

    def __init__(self, device, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs) -> list[int]:
        """logits ``[n, vocab]`` (any float dtype), ``seqs``: the n sequences, in row order -> n token ids."""
        params = [s.params for s in seqs]
        if any(p.repetition_penalty != 1.0 for p in params):
            logits = self.penalize(logits.float(), seqs)
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = self.probabilities(logits[rows].float(), [params[i] for i in rows])
        noise = torch.empty_like(probs)
        seeded = [r for r, i in enumerate(rows) if seqs[i].params.seed is not None]
        if len(seeded) < len(rows):  # the unseeded rows in one draw from the engine's generator
            noise.exponential_(1.0, generator=self.generator)
        for r in seeded:  # each seeded row from its own generator: independent of the batch
            noise[r].exponential_(1.0, generator=self._generator(seqs[rows[r]]))
        sampled = greedy.clone()
        sampled[rows] = (probs / noise).argmax(dim=-1)
        return sampled.tolist()

    def _generator(self, seq) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    @staticmethod
    def penalize(logits: torch.Tensor, seqs) -> torch.Tensor:
        """``logits`` fp32 ``[n, vocab]`` with the repetition penalty of each row's sequence applied
        to every token of its prompt and output (a new tensor)."""
        out = logits.clone()
        for i, seq in enumerate(seqs):
            r = seq.params.repetition_penalty
            if r == 1.0:
                continue
            ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=logits.device)
            seen = out[i, ids]
            out[i, ids] = torch.where(seen > 0, seen / r, seen * r)
        return out

    @staticmethod
    def probabilities(logits: torch.Tensor, params) -> torch.Tensor:
        """fp32 ``[n, vocab]`` -> the distributions to draw from: ``softmax(logits / temperature)``
        cut by each row's top_k, top_p and min_p (cut entries 0)."""
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if not any(p.filtered for p in params):
            return probs
        vocab = logits.shape[-1]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], dtype=torch.float32, device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=logits.device)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        cut = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None])
        cut |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        cut[:, 0] = False  # the most likely token always stays
        keep = torch.zeros_like(cut).scatter_(1, order, ~cut)
        return torch.where(keep, probs, 0.0)

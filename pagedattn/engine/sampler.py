"""Next-token sampling: greedy (temperature 0) and temperature sampling, per sequence."""

from __future__ import annotations

import torch


class Sampler:
    """``temperature > 0``: a draw from ``softmax(logits / temperature)`` (the exponential-race
    form ``argmax(p / E)``, ``E ~ Exp(1)``, from a seeded generator); 0: argmax."""

    def __init__(self, device, seed: int = 0):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, temperatures: list[float]) -> list[int]:
        """logits ``[n, vocab]`` (any float dtype), one temperature per row -> n token ids."""
        greedy = logits.argmax(dim=-1)
        if all(t <= 0 for t in temperatures):
            return greedy.tolist()
        temps = torch.tensor(temperatures, dtype=torch.float32).to(logits.device)
        probs = torch.softmax(logits.float() / temps.clamp_min(1e-5)[:, None], dim=-1)
        race = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        sampled = (probs / race).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy).tolist()

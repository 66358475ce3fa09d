"""Request fields both generation endpoints share: sampling options, one definition."""

from __future__ import annotations

import secrets

from pydantic import BaseModel, ConfigDict, Field

from model.sampling import SamplingParams

MAX_N = 64  # samples per request; the server's --max-batch may allow fewer


class SamplingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=MAX_N, description="samples to draw (at most --max-batch)")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=256, description="0 = off")
    seed: int | None = Field(None, ge=0, lt=2**62, description="sample i uses seed + i; default random")

    def sampling(self) -> SamplingParams:
        seed = self.seed if self.seed is not None else secrets.randbits(31)
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed)

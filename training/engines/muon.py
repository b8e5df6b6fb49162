"""Muon beside AdamW as one torch optimizer, for the native engines: one step, one state dict.
torch.optim.Muon takes 2-D parameters only, so the embeddings, norms and biases it leaves are
AdamW's (engines/optim.py: muon_split)."""

from __future__ import annotations

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    """Owns the two optimizers' param groups (Muon's first) and one state keyed by parameter,
    so the base class's state_dict, load_state_dict, zero_grad and every reader of
    `param_groups` (clipping, the GradScaler, distributed checkpoint) see a single optimizer."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        self._muon_groups = len(muon.param_groups)
        super().__init__([*muon.param_groups, *adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        # load_state_dict replaces the groups and the state: hand the new ones back to both.
        self.muon.param_groups = self.param_groups[: self._muon_groups]
        self.adamw.param_groups = self.param_groups[self._muon_groups :]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

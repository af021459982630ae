"""graphtree._torch.grad_off_inside: which callables run with autograd off whatever the caller's mode
(the GPU test: tests/gpu/test_real_paths_gpu.py, a method decorated with @torch.no_grad() graphed)."""

from __future__ import annotations

import torch
from torch import nn

from graphtree import _torch


@torch.no_grad()
def _no_grad(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.inference_mode()
def _inference(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.inference_mode(False)
def _inference_off(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.enable_grad()
def _grad_on(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _Decorated(nn.Module):
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_functions_methods_and_modules_decorated_to_turn_grad_off_are_found() -> None:
    m = _Decorated()
    assert _torch.grad_off_inside(_no_grad)
    assert _torch.grad_off_inside(_inference)
    assert _torch.grad_off_inside(m)  # its forward
    assert _torch.grad_off_inside(m.step)  # a bound method
    assert _torch.grad_off_inside(_Decorated.step)


def test_anything_else_is_not() -> None:
    for fn in (_inference_off, _grad_on, _plain, nn.Linear(2, 2), lambda x: x, print, 3):
        assert not _torch.grad_off_inside(fn), fn

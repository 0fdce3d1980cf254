"""Train a small plain-PyTorch model through cfp_megatron's deepspeed.initialize hook (ZeRO-1, CPU, gloo).

Run by tests/test_deepspeed_hook.py in its own process (DeepSpeed sets process-wide state). Prints one JSON line.
"""

import json
import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402

from cfp_megatron.model.deepspeed_hook import initialize  # noqa: E402


class Block(torch.nn.Module):
    """A residual LayerNorm + Linear block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Net(torch.nn.Module):
    """Embedding, four blocks, output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])
        self.out = torch.nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def main() -> None:
    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    model = Net()
    ids = torch.randint(0, 100, (2, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = initialize(model=model, example_input=ids, optimizer=optimizer,
                                 config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    losses = []
    for _ in range(5):
        logits = engine(ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 100), ids.view(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    capture = model.cfp_capture
    print(json.dumps({"kinds": {k: g.param_count for k, g in capture.graphs.items()},
                      "sequence": list(capture.sequence), "losses": losses,
                      "zero_stage": engine.zero_optimization_stage()}))


if __name__ == "__main__":
    main()

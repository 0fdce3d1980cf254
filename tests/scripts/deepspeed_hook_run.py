"""Train a small plain-PyTorch model through cfp_megatron's deepspeed.initialize hook (CPU, gloo).

Run by tests/test_deepspeed_hook.py in its own processes (DeepSpeed sets process-wide state). Prints one JSON line.

- no argument: ZeRO-1 from a concrete config (nothing planned), 5 steps;
- ``planned OUTPUT_DIR``: on every rank of a gloo job, the hook plans a config with ``"auto"`` stage, micro-batch and
  accumulation (probing every stage's engine), then one with the stage pinned to 2 (probing that stage); each trains
  :data:`STEPS` steps of the global batch; every ``deepspeed.initialize`` call is recorded (on the user's model or
  a copy, the user's weights and RNG state unchanged at that point);
- ``reference``: one rank, ZeRO-0, the whole global batch in one micro-batch (nothing planned).
"""

import gc
import json
import sys
import time
import weakref

import torch

from cfp_megatron.compat.import_cost import heavy_imports  # noqa: E402

with heavy_imports():  # the hook's Megatron-Core and DeepSpeed, imported with their import costs cut
    import torch.distributed as dist  # noqa: E402

    from cfp_megatron.compat.deepspeed_import import import_deepspeed  # noqa: E402

    # on the CPU accelerator, and without the shared-memory all-reduce only DeepSpeed's inference calls (as the
    # backend=deepspeed launch imports it)
    deepspeed = import_deepspeed()

    from cfp_megatron.backends.deepspeed.hook import initialize  # noqa: E402

GLOBAL_BATCH = 8
"""Sequences per optimizer step."""
STEPS = 3
"""Optimizer steps per run."""
SEQ = 512
"""Tokens per sequence."""


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


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 100), ids.reshape(-1))


def _config(**values: object) -> dict:
    """A DeepSpeed config with torch's AdamW (as the backend's ds_config has it) and ``values``."""
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 10**9,
            **values}


def _train(engine: object) -> list[float]:
    """:data:`STEPS` steps over the same global batches on any number of ranks; the mean loss of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mb, steps = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    per_rank = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        batch = torch.randint(0, 100, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
        total = torch.zeros(())
        for k in range(steps):
            ids = batch[rank * per_rank + k * mb: rank * per_rank + (k + 1) * mb]
            loss = _loss(engine(ids), ids)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / steps
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _same(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def _planned(example: torch.Tensor, config: dict, output_dir: str | None) -> dict:
    torch.manual_seed(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    calls: list[dict] = []  # every deepspeed.initialize: the probes' (around copies), then the user's engine
    copies: list[weakref.ref] = []
    real = deepspeed.initialize

    def spy(*, model: torch.nn.Module, **kwargs: object) -> object:
        calls.append({"user_model": model is user, "weights_unchanged": _same(user, before),
                      "rng_unchanged": torch.equal(rng, torch.get_rng_state())})
        if model is not user:
            copies.append(weakref.ref(model))
        return real(model=model, **kwargs)

    user = model
    deepspeed.initialize = spy
    began = time.perf_counter()
    try:
        engine, _, _, _ = initialize(model=model, example_input=example, config=config, output_dir=output_dir,
                                     model_parameters=model.parameters(),
                                     loss_fn=lambda out: out.logsumexp(-1).mean())
    finally:
        deepspeed.initialize = real
    hooked = time.perf_counter() - began
    gc.collect()
    alive = sum(c() is not None for c in copies)  # the probes' copies and engines are freed (ZeRO-3's too)
    plan = model.cfp_plan
    unchanged = _same(model, before) if engine.zero_optimization_stage() < 3 else None  # ZeRO-3 partitioned them
    probes = plan.probes.stages.values() if plan.probes is not None else ()
    result = {"canonical": plan.plan.canonical(), "stage": engine.zero_optimization_stage(),
              "mb": engine.train_micro_batch_size_per_gpu(), "ga": engine.gradient_accumulation_steps(),
              "train_batch_size": engine.train_batch_size(), "planning_s": plan.planning_s, "hook_s": hooked,
              "collectives": plan.collectives, "written": str(plan.written) if plan.written else None,
              "weights_unchanged": unchanged, "probed": list(plan.probed_stages), "probe_s": plan.probe_s,
              "probes": {str(p.stage): [list(point) for point in p.points] for p in probes},
              "initialize_calls": calls, "probe_copies_alive": alive, "losses": _train(engine)}
    engine.destroy()
    return result


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    mode = sys.argv[1] if len(sys.argv) > 1 else "zero1"
    if mode == "planned":
        example = torch.randint(0, 100, (2, SEQ))
        auto = _planned(example, _config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu="auto",
                                         gradient_accumulation_steps="auto",
                                         zero_optimization={"stage": "auto"}), sys.argv[2])
        pinned = _planned(example, _config(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu="auto",
                                           zero_optimization={"stage": 2}), None)
        print(json.dumps({"rank": dist.get_rank(), "auto": auto, "pinned": pinned}))
        return
    if mode == "reference":
        torch.manual_seed(0)
        model = Net()
        engine, _, _, _ = initialize(model=model, example_input=torch.randint(0, 100, (2, SEQ)),
                                     model_parameters=model.parameters(),
                                     config=_config(train_batch_size=GLOBAL_BATCH,
                                                    train_micro_batch_size_per_gpu=GLOBAL_BATCH,
                                                    gradient_accumulation_steps=1, zero_optimization={"stage": 0}))
        print(json.dumps({"losses": _train(engine), "planned": hasattr(model, "cfp_plan")}))
        return
    torch.manual_seed(0)
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
    # As a training script ends: the process group destroyed before the interpreter's teardown, which otherwise
    # meets gloo's threads still running ("terminate called without an active exception", exit -6).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""Run by tests/fusion/test_compose.py, alone (--mode none) or under torchrun (ddp, fsdp): a tiny
random HF Llama, ``fuseformer.optimize(training=True)`` (unless --plain), wrapped in DDP or FSDP2
after optimize, three SGD steps on a fixed batch of 4 rows split across the ranks; rank 0 writes
the losses and the final weights (by their original names)."""

import argparse
import os

import torch
import torch.distributed as dist


def tiny_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="none", choices=["none", "ddp", "fsdp"])
    p.add_argument("--plain", action="store_true", help="do not optimize (the reference run)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.mode != "none":
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.mode != "none" else (0, 1)
    model = tiny_llama()
    if not args.plain:
        import fuseformer

        report = fuseformer.optimize(model, training=True)
        assert report.counts(), str(report)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    elif args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = model
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    rows = ids[rank * 4 // world : (rank + 1) * 4 // world]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = wrapped(input_ids=rows, labels=rows).loss
        loss.backward()
        opt.step()
        if args.mode != "none":
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    state = model.state_dict()
    if args.mode == "fsdp":
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
    if rank == 0:
        torch.save({"losses": losses, "state": {k: v.detach().clone() for k, v in state.items()}}, args.out)
    if args.mode != "none":
        # As Trainer.close does: the DDP/FSDP state that holds the process group is freed first, then
        # the group goes after a barrier; a group freed at interpreter exit aborted a rank now and then
        # with gloo's "terminate called without an active exception" (2026-12-04, 2026-12-07).
        import gc

        from fuseformer.train.distributed import destroy

        del wrapped, model, opt, state
        gc.collect()
        destroy()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

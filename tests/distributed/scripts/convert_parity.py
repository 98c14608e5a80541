"""Converted checkpoints at one parallel layout on 2 gloo ranks: parity with transformers.

Usage: convert_parity.py LAYOUT WORKDIR OUT_JSON   (LAYOUT: tp1 = TP1/PP1/DP2, tp2, pp2)

WORKDIR holds, per model NAME (see tests/unit/hf_tiny_models.py): NAME/ (HF dir), NAME.ref.pt
(tokens and transformers outputs) and NAME.mg/ (converted with tools/convert_hf_to_megatron.py).
For each model, on this layout:
  a. load NAME.mg through dist_checkpointing.load (resharding) and compare logits / scores with HF;
  b. load the HF tensors directly (hf_mapping.load_hf_weights) and compare the same way;
  c. stream the weights back out (hf_mapping.iter_hf_weights): exactly the HF names and shapes,
     bit-identical values;
  d. (tp2) let Megatron itself save the TP=2 model, convert that to HF and compare bit-identically,
     and compare its keys/global shapes with the converter's checkpoint.
Also (tp1): a causal LM converted with --head scalar loads into a reward model (zero head -> 0 scores).
Rank 0 writes {model: {check: value}} to OUT_JSON.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint import hf as ckpt_hf
from megatron_rlhf.models import hf_mapping as hm
from megatron_rlhf.models.build import build_model
from megatron_rlhf.parallel.init import destroy, initialize
from megatron_rlhf.parallel.layout import ParallelConfig

LAYOUTS = {"tp1": ParallelConfig(tp=1, pp=1), "tp2": ParallelConfig(tp=2, pp=1), "pp2": ParallelConfig(tp=1, pp=2)}


@torch.no_grad()
def forward(chunks, tokens, cfg):
    """Full outputs [b, s, V or 1] on the last pipeline stage (TP-gathered, vocab trimmed); None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    collected = []

    def step(data_iter, model):
        out = model(next(data_iter), pos, None)

        def loss_fn(output):
            collected.append(output.detach())
            return output.sum() * 0.0, {}

        return out, loss_fn

    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([tokens]),
        model=chunks,
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=True,
    )
    if not ps.is_pipeline_last_stage():
        return None
    (out,) = collected
    tp = ps.get_tensor_model_parallel_world_size()
    if out.shape[-1] != 1 and tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out[..., : cfg.vocab_size] if out.shape[-1] != 1 else out


def compare(out, ref):
    """Max |diff| against the HF reference on the last stage; gathered so every rank agrees."""
    from tests.unit.hf_tiny_models import last_real

    if out is None:
        diff = None
    elif "scores" in ref:
        rows = torch.arange(out.shape[0])
        diff = (out[rows, last_real(ref["tokens"]), 0] - ref["scores"][:, 0]).abs().max().item()
    else:
        diff = (out - ref["logits"]).abs().max().item()
    diffs = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    measured = [d for d in diffs if d is not None]
    assert measured, "no rank computed outputs"
    return max(measured)


def stream_check(chunks, cfg, head, hf_dir):
    """Names, shapes and values of the streamed weights against the HF files."""
    src = ckpt_hf.HFCheckpoint(hf_dir)
    names, shapes, mismatched = [], {}, []
    for name, t in hm.iter_hf_weights(chunks, cfg, head):
        names.append(name)
        shapes[name] = list(t.shape)
        if not torch.equal(t, src.get(name)):
            mismatched.append(name)
    hf_names = sorted(src.names())
    return {
        "stream_names_equal": sorted(names) == hf_names and len(names) == len(set(names)),
        "stream_shapes_equal": all(shapes[n] == list(src.shape(n)) for n in names if n in hf_names),
        "stream_mismatched": mismatched,
        "stream_count": len(names),
    }


def megatron_saved_roundtrip(chunks, cfg, head, model_dir, work, name):
    """Megatron saves the model at this layout; convert that checkpoint to HF; compare with the source."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    saved = work / f"{name}.megatron_saved"
    if dist.get_rank() == 0:
        saved.mkdir()
    dist.barrier()
    dist_checkpointing.save(chunks[0].sharded_state_dict(prefix=""), str(saved))
    res = {}
    if dist.get_rank() == 0:
        meta = ckpt_hf.ConvertMeta.read(model_dir.with_suffix(".mg"))
        meta.write(saved)
        out = work / f"{name}.megatron_saved.hf"
        ckpt_hf.megatron_to_hf(saved, out)
        a, b = ckpt_hf.HFCheckpoint(model_dir), ckpt_hf.HFCheckpoint(out)
        res["saved_hf_names_equal"] = sorted(a.names()) == sorted(b.names())
        res["saved_hf_mismatched"] = [n for n in a.names() if not torch.equal(a.get(n), b.get(n))]
        # The converter writes what Megatron writes: same keys, same global shapes (vocab unpadded).
        mine = FileSystemReader(str(model_dir.with_suffix(".mg"))).read_metadata().state_dict_metadata
        theirs = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
        # megatron-core 0.19 keeps the (empty) common state among the shards; the converter writes a common.pt,
        # which both releases read.
        theirs = {k: v for k, v in theirs.items() if not k.startswith("common_state/")}
        res["ckpt_keys_equal"] = set(mine) >= set(theirs)
        res["ckpt_key_diff"] = sorted(set(theirs) - set(mine))
        res["ckpt_shapes_differ"] = sorted(
            k
            for k in theirs
            if k in mine and hasattr(theirs[k], "size") and tuple(theirs[k].size) != tuple(mine[k].size)
        )
    dist.barrier()
    return res


def run_model(name, par, work, layout):
    ref = torch.load(work / f"{name}.ref.pt")
    mg_dir, hf_dir = work / f"{name}.mg", work / name
    meta = ckpt_hf.ConvertMeta.read(mg_dir)
    cfg, head = meta.config(), meta.head
    res = {}

    chunks = build_model(cfg, par, head=head)
    for c in chunks:
        c.eval()
    ckpt_hf.load_megatron_into_model(chunks, mg_dir)
    res["ckpt_max_diff"] = compare(forward(chunks, ref["tokens"], cfg), ref)
    res.update(stream_check(chunks, cfg, head, hf_dir))
    if layout == "tp2":
        res.update(megatron_saved_roundtrip(chunks, cfg, head, hf_dir, work, name))

    fresh = build_model(cfg, par, head=head)
    for c in fresh:
        c.eval()
    ckpt_hf.load_hf_into_model(fresh, hf_dir)
    res["hf_direct_max_diff"] = compare(forward(fresh, ref["tokens"], cfg), ref)
    return res


def seeded_reward_model(par, work):
    """A causal LM converted with --head scalar: loads into a reward model whose fresh head scores 0."""
    mg = work / "llama.seed_rm.mg"
    meta = ckpt_hf.ConvertMeta.read(mg)
    cfg = meta.config()
    chunks = build_model(cfg, par, head="scalar")
    for c in chunks:
        c.eval()
    with torch.no_grad():
        for p in chunks[-1].output_layer.parameters():
            p.fill_(1.0)  # must be overwritten by the checkpoint's zero head
    ckpt_hf.load_megatron_into_model(chunks, mg)
    ref = torch.load(work / "llama.ref.pt")
    out = forward(chunks, ref["tokens"], cfg)
    val = None if out is None else out.abs().max().item()
    vals = [None] * dist.get_world_size()
    dist.all_gather_object(vals, val)
    return {"head": meta.head, "max_abs_score": max(v for v in vals if v is not None)}


def main():
    layout, work, out_json = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    models = sys.argv[4].split(",") if len(sys.argv) > 4 else ["llama", "mistral", "qwen2", "llama_rm"]
    par = LAYOUTS[layout]
    initialize(par, seed=1234)
    results = {}
    for name in models:
        results[name] = run_model(name, par, work, layout)
    if layout == "tp1" and (work / "llama.seed_rm.mg").exists():
        results["seed_rm"] = seeded_reward_model(par, work)
    if dist.get_rank() == 0:
        Path(out_json).write_text(json.dumps(results, indent=1))
    destroy()


if __name__ == "__main__":
    main()

"""The hybrid engine on 2 gloo ranks: weight swap between layouts, generation, redistribution.

Usage: torchrun --nproc_per_node 2 hybrid_swap.py OUT.json CKPT_DIR
Phase tp1 (training TP=1 x DP=2): a tiny LM is built and saved (dist_checkpointing); the reference
    is the plain sampler on this one-rank model over the whole batch (greedy and sampled with
    per-row draws). Generation at TP=2 (DP=1) from training DP shares of 3 and 2 prompts.
Phase tp2 (training TP=2): weights loaded resharded by dist_checkpointing; generation at TP=1 x DP=2;
    reference and reward loaded at inference TP=1; ppo.reference_mode=swap's host reference at TP=2.
Phase pp2 (training PP=2): the SAME generation model as phase tp2 as the target of a new swap: the
    plan cached by megatron for the TP=2 source must be dropped (stale-plan trap). This swap uses gloo
    P2P (the transport of ranks on several hosts); the others use the shared-memory one.
Phase vpp (training PP=2 x VPP=2, DDP + Adam): generation at TP=1; then train 2 steps with a swap and
    a generation between them, and 2 steps without: the weights must agree to the bit.
Every engine releases the training weights while it decodes (rollout.release_training_weights, run on
CPU here). Every phase: the generation model's full weights equal the training model's (gathered over TP and
PP) and the responses equal the reference rows (tokens exactly, logprobs to 1e-5). Rank 0 writes
both ranks' results.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.config.schema import TrainConfig
from megatron_rlhf.models import hf_mapping as H
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.rollout.base import SamplingParams
from megatron_rlhf.rollout.hybrid import HybridRolloutEngine, WeightSwap
from megatron_rlhf.rollout.megatron_engine import generate
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.step import make_forward_step, train_step

VOCAB, PAD, EOS, T = 63, 0, 7, 10  # padded to 64 at TP=1 and TP=2: one padded id
CFG = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=VOCAB, max_position_embeddings=64, init_method_std=0.2, make_vocab_size_divisible_by=2)
LENGTHS = [5, 2, 8, 1, 6]  # 5 rows: uneven over 2 generation DP ranks (3 + 3 with one padding row)


def prompts():
    g = torch.Generator().manual_seed(0)
    s = max(LENGTHS) + 1
    ids = torch.full((len(LENGTHS), s), PAD, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, s - n:] = torch.randint(1, VOCAB, (n,), generator=g)
    mask = torch.arange(s).unsqueeze(0) >= (s - torch.tensor(LENGTHS)).unsqueeze(1)
    draws = torch.rand(len(LENGTHS), T, generator=torch.Generator().manual_seed(1))
    return ids, mask, draws


CASES = {"greedy": SamplingParams(T, 1.0, greedy=True), "sample": SamplingParams(T, 0.8)}


def reference(model):
    ids, mask, draws = prompts()
    out = {}
    for name, sp in CASES.items():
        r = generate(model, ids, prompt_mask=mask, max_new_tokens=T, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                     temperature=sp.temperature, greedy=sp.greedy, uniforms=None if sp.greedy else draws)
        out[name] = {k: v.tolist() for k, v in r.items()}
    return out


def hybrid_generate(engine, rows):
    ids, mask, draws = prompts()
    out = {}
    for name, sp in CASES.items():
        r = engine.generate(ids[rows], mask[rows], sp, uniforms=None if sp.greedy else draws[rows])
        out[name] = {k: v.tolist() for k, v in r.items()}
    return out


def full_weights(chunks, tp_group):
    """{global megatron name: full tensor (vocab padding trimmed)} of a model, merged over all ranks."""
    local = {}
    tp = dist.get_world_size(tp_group)
    for name, p in H.named_global_parameters(chunks).items():
        if name == "output_layer.weight" and CFG.tie_embeddings:
            continue
        rule, _ = H.match_megatron(name, CFG)
        shards = [p.detach()]
        if tp > 1 and rule.kind != "replicated":
            shards = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(shards, p.detach().contiguous(), group=tp_group)
        local[name] = H.unshard(rule, shards, CFG).clone()
    merged = [None] * dist.get_world_size()
    dist.all_gather_object(merged, local)
    out = {}
    for m in merged:
        out.update(m)
    return out


def same_weights(gen_model, gen_tp_group, train_chunks):
    """The copy holds the training weights, and no element of its own is left unwritten: `engine_for` fills it
    with NaN, and the vocabulary's padding row (which `full_weights` trims) must have been swapped in too."""
    from megatron.core import parallel_state as ps

    a, b = full_weights([gen_model], gen_tp_group), full_weights(train_chunks, ps.get_tensor_model_parallel_group())
    written = all(bool(torch.isfinite(p).all()) for p in gen_model.parameters())
    return written and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def load(parallel, ckpt_dir, mode="load"):
    from megatron.core import dist_checkpointing

    init.initialize(parallel, seed=5)
    torch.manual_seed(5)
    chunks = build_model(CFG, parallel)
    state = {f"chunk{i}": c.sharded_state_dict(prefix="") for i, c in enumerate(chunks)}
    if mode == "save":
        dist_checkpointing.save(state, ckpt_dir)
    else:
        loaded = dist_checkpointing.load(state, ckpt_dir)
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[f"chunk{i}"])
    return chunks


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def engine_for(chunks, parallel, tp):
    # release_device="cpu": the training weights really leave (empty storages) while the copy decodes,
    # so a decode that read them would fail, and every later check sees them restored.
    # The copy is built without drawing its weights; NaN makes any element the first swap misses show.
    engine = HybridRolloutEngine(chunks, CFG, parallel.tp, tp, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                                 release_device="cpu")
    with torch.no_grad():
        for p in engine.model.parameters():
            p.fill_(float("nan"))
    return engine


def lm_batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (4, 12), generator=g)
    return [{"input_ids": ids[i:i + 2], "labels": torch.roll(ids[i:i + 2], -1, 1),
             "loss_mask": torch.ones(2, 12)} for i in (0, 2)]


def lm_loss(output, batch):
    s, n = (output.float() * batch["loss_mask"]).sum(), batch["loss_mask"].sum()
    return s, n, {"loss": (s.detach(), n)}


def experience(out):
    from megatron_rlhf.trainer.ppo.batch import build_experience

    ids, mask, _ = prompts()
    rows = [r[m].tolist() for r, m in zip(ids, mask)]
    return build_experience(rows, {k: torch.tensor(v) for k, v in out.items()}, PAD)


def frozen_in_inference_layout(chunks, parallel, ckpt_root, generated):
    """Reference (the policy) and a reward model saved from training TP=2, loaded at inference TP=1:
    response log-probs and scores against the training-layout models (max |difference|)."""
    from types import SimpleNamespace

    from megatron_rlhf.checkpoint import state as ckpt
    from megatron_rlhf.rollout.layout import tp_only_layout
    from megatron_rlhf.trainer.ppo.experience import forward_collect, last_token_scores, response_logprobs, scoring_rows
    from megatron_rlhf.trainer.ppo.inference_layout import build_inference_model

    torch.manual_seed(9)
    reward = build_model(CFG, parallel, head="scalar")
    torch.nn.init.normal_(reward[-1].output_layer.weight, std=0.1)  # a zero head would score every row 0
    ckpt.save_checkpoint(ckpt_root, 1, {"policy": chunks, "reward": reward}, {}, {}, {})
    mbs = experience(generated).microbatches(2)
    layout, cfg = tp_only_layout(1), SimpleNamespace(parallel=parallel)
    result = {}
    for name, train_model, head in (("reference", chunks, "lm"), ("reward", reward, "scalar")):
        extract = last_token_scores if head == "scalar" else (lambda o, mb: response_logprobs(o, mb, VOCAB, 0.8))
        rows = [scoring_rows(mb) for mb in mbs] if head == "scalar" else mbs  # what a reward model reads
        expected = torch.cat(forward_collect(train_model, rows, extract))
        inference = build_inference_model(cfg, CFG, layout, head, ckpt_root, name if head == "scalar" else "policy", 0.8)
        got = torch.cat(forward_collect(inference, rows, extract))
        result[name] = {"max_diff": float((got - expected).abs().max()), "spread": float(expected.std()),
                        "shape": list(got.shape) == list(expected.shape)}
    result["reference_swap"] = reference_swap_at_tp2(chunks, mbs)
    return result


def reference_swap_at_tp2(chunks, mbs):
    """ppo.reference_mode=swap at training TP=2: the reference weights (these chunks as they are) kept in host
    memory, the policy moved on, then the reference forward through the swap: the same logprobs to the bit,
    and the moved policy restored to the bit. (Last use of `chunks`: they are perturbed here.)"""
    from megatron_rlhf.trainer.ppo.experience import forward_collect, response_logprobs
    from megatron_rlhf.trainer.ppo.reference_swap import HostReference

    extract = lambda o, mb: response_logprobs(o, mb, VOCAB, 0.8)  # noqa: E731
    expected = torch.cat(forward_collect(chunks, mbs, extract))
    reference = HostReference(chunks)
    with torch.no_grad():
        for p in (p for c in chunks for p in c.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    moved = [p.detach().clone() for c in chunks for p in c.parameters()]
    got = torch.cat(forward_collect(reference, mbs, extract))
    policy = torch.cat(forward_collect(chunks, mbs, extract))
    return {"equal": torch.equal(got, expected), "policy_differs": float((policy - expected).abs().max()) > 1e-3,
            "restored": all(torch.equal(a, p) for a, p in zip(moved, (p for c in chunks for p in c.parameters())))}


def trained_weights(parallel, ckpt_dir, swap_between):
    """Two optimizer steps (with or without a swap + generation after the first) -> full weights."""
    from megatron.core import parallel_state as ps

    chunks = wrap_ddp(load(parallel, ckpt_dir), False)
    optimizer, scheduler = build_optimizer(chunks, TrainConfig(lr=1e-2, lr_schedule="constant"), False, total_steps=2)
    fwd = make_forward_step(lm_loss, lambda b: {"labels": b["labels"]})
    engine = engine_for(chunks, parallel, 1) if swap_between else None
    extra = {}
    for step in range(2):
        train_step(chunks, optimizer, scheduler, lm_batch(step), fwd)
        if engine is not None and step == 0:
            hybrid_generate(engine, slice(None))
    if engine is not None:  # the cached plan, reused after a step, still copies the right weights
        engine.swap()
        extra = {"same_after_step": same_weights(engine.model, engine.layout.pg_collection.tp, chunks),
                 "plans_built": engine.swap.plans_built}
    return full_weights(chunks, ps.get_tensor_model_parallel_group()), extra


def main(out_path, ckpt_dir):
    os.makedirs(ckpt_dir, exist_ok=True)
    result = {}
    # Phase tp1: reference, save; then training DP=2 -> generation TP=2.
    parallel = ParallelConfig(tp=1)
    chunks = load(parallel, ckpt_dir, "save")
    rank = dist.get_rank()
    result["reference"] = reference(chunks[0])
    share = slice(0, 3) if rank == 0 else slice(3, 5)
    engine = engine_for(chunks, parallel, 2)
    result["tp1_to_tp2"] = {"rows": [share.start, share.stop], "out": hybrid_generate(engine, share),
                            "same": same_weights(engine.model, engine.layout.pg_collection.tp, chunks)}
    dist.barrier()
    # Phase tp2 -> generation TP=1.
    parallel = ParallelConfig(tp=2)
    chunks = load(parallel, ckpt_dir)
    engine = engine_for(chunks, parallel, 1)
    result["tp2_to_tp1"] = {"out": hybrid_generate(engine, slice(None)),
                            "same": same_weights(engine.model, engine.layout.pg_collection.tp, chunks)}
    result["inference_tp1"] = frozen_in_inference_layout(chunks, parallel, os.path.join(ckpt_dir, "frozen"),
                                                         result["reference"]["sample"])
    # Phase pp2 -> the same generation model, a new source layout: the cached plan must go.
    gen_model, gen_tp = engine.model, engine.layout.pg_collection.tp
    old_plan = getattr(gen_model, "_cached_reshard_plan")
    parallel = ParallelConfig(pp=2)
    chunks = load(parallel, ckpt_dir)
    engine.swap = WeightSwap(chunks, gen_model, transport="gloo")  # the several-hosts path: gloo P2P
    result["pp2_to_tp1"] = {"out": hybrid_generate(engine, slice(None)), "same": same_weights(gen_model, gen_tp, chunks),
                            "plan_rebuilt": getattr(gen_model, "_cached_reshard_plan") is not old_plan}
    # Phase vpp: PP=2 x VPP=2 -> TP=1, and training continues bit-identically after a swap.
    parallel = ParallelConfig(pp=2, vpp=2)
    chunks = load(parallel, ckpt_dir)
    engine = engine_for(chunks, parallel, 1)
    result["vpp_to_tp1"] = {"out": hybrid_generate(engine, slice(None)),
                            "same": same_weights(engine.model, engine.layout.pg_collection.tp, chunks)}
    with_swap, extra = trained_weights(parallel, ckpt_dir, True)
    without, _ = trained_weights(parallel, ckpt_dir, False)
    result["continue"] = {**extra, "bit_identical": sorted(with_swap) == sorted(without)
                          and all(torch.equal(with_swap[k], without[k]) for k in with_swap),
                          "moved": any(not torch.equal(with_swap[k], full_w) for k, full_w in
                                       full_weights(load(parallel, ckpt_dir), tp_group()).items())}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    init.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Does a measure tell the CNN, where top-k keeps quality under momentum SGD, from the
transformer, where it costs about 2%? The share of the accumulated gradient's energy that top-k
at 1% sends, over the whole fused buffer, with error feedback.

One process trains each workload densely under its recipe with the batch of two ranks (the
optimizer sees the dense gradient, so both runs follow dense training); beside it a top-k of the
fused buffer with error feedback runs on the same gradients from step 101 (after the compressors'
100-step warm-up): acc = gradient + residual, the top 1% of |acc| sent, the rest kept. At some steps
it records the share of the gradient's energy in its own top 1% (``grad_top_share``), the share of
acc's energy that top-k sends (``acc_sent_share``) and the per-gradient top-1% share over the
gradients of 16384 elements or more (median and minimum).

    python studies/topk_energy_share.py lm  > lm.jsonl    # the transformer, momentum SGD then AdamW
    python studies/topk_energy_share.py cnn > cnn.jsonl   # ResNet-18 on the cluttered digits, momentum SGD

Records: docs/results/data/accuracy/topk-energy-share.jsonl; the answer is in
docs/results/accuracy.md (the section on PowerSGD's rank and top-k's ramp).
"""
import json
import sys

import numpy as np
import torch

from horovod_sparse.workloads import cluttered_resnet, recipes, stdlib_lm


def run(workload, recipe_name, steps, size, batch, checkpoints, density=0.01):
    recipe = recipes.recipe_for(workload, recipe_name)
    model = workload.build_model(seed=0, **size)
    opt = recipe.optimizer(model.parameters())
    schedule = recipe.schedule(opt, 1000)
    data = workload.batches(0, 1, batch)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    k = int(density * n)
    residual = torch.zeros(n)
    for step in range(1, steps + 1):
        opt.zero_grad()
        workload.loss(model, next(data)).backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        acc = g + residual
        top = acc.abs().topk(k).indices
        sent = torch.zeros(n)
        sent[top] = acc[top]
        if step > 100:  # top-k with error feedback after a 100-step dense warm-up
            residual = acc - sent
        if step in checkpoints:
            shares, offset = [], 0
            for p in params:
                m = p.numel()
                part = g[offset:offset + m]
                offset += m
                if m >= 16384:
                    shares.append(float(part.abs().topk(max(1, int(density * m))).values.pow(2).sum()
                                        / part.pow(2).sum()))
            print(json.dumps(dict(
                workload=workload.NAME, recipe=recipe_name, step=step,
                grad_top_share=float(g.abs().topk(k).values.pow(2).sum() / g.pow(2).sum()),
                acc_sent_share=float(sent.pow(2).sum() / acc.pow(2).sum()),
                per_tensor_median=float(np.median(shares)), per_tensor_min=float(np.min(shares)),
                tensors=len(shares))), flush=True)
        opt.step()
        schedule.step()


def main(which):
    torch.set_num_threads(2)
    at = {50, 100, 200, 300, 400}
    if which == "lm":
        for recipe in ("momentum", "adamw"):
            run(stdlib_lm, recipe, 400, dict(layers=4, d_model=256, heads=4), 8, at)
    else:
        run(cluttered_resnet, "momentum", 400, {}, 64, at)


if __name__ == "__main__":
    main(sys.argv[1])

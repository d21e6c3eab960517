"""A plain torchrun-compatible user script: joins the process group from torchrun's environment,
all-reduces its rank, and writes what it saw to OUT_DIR/rank<R>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "rank_sum": total.item(), "argv": sys.argv[1:]}, f)
dist.destroy_process_group()

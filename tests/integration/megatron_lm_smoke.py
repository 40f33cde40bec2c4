"""Run inside a patched Megatron-LM core_v0.16.1 tree (by test_patches.py): build the model
through Megatron-LM's own gpt_builder/model_provider and train two steps on CPU through the
patched pretrain_gpt.py's dataset provider, forward_step and loss_func.

    python megatron_lm_smoke.py DATA_PREFIX CLUSTER_YAML      (prints one line per step)

Megatron-LM's training loop itself needs CUDA; everything it calls per step runs here on a
one-rank gloo world with the tiny-cpu preset's flags.
"""

import os
import subprocess
import sys
from functools import partial

prefix, cluster = sys.argv[1:3]
argv = subprocess.run([sys.executable, "-m", "megatron_zeppelin.launch", "--preset", "tiny-cpu", "--print-args",
                       "--only", "megatron"], capture_output=True, text=True, check=True).stdout.split()
os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
sys.argv = ["pretrain_gpt.py", *argv, "--use-cpu-initialization", "--global-batch-size", "1",
            "--data-path", prefix, "--zeppelin-cluster", cluster, "--split", "90,10,0"]

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.rerun_state_machine import RerunDataIterator  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.global_vars import _set_timers, set_args  # noqa: E402

from megatron_zeppelin import integration as zeppelin  # noqa: E402

args = parse_args(zeppelin.chain_args_providers(None, zeppelin.add_zeppelin_args))
validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
args.padded_vocab_size = 384  # what Megatron pads NullTokenizer's 257 to (tokenizer building skipped)
args.iteration, args.consumed_valid_samples = 0, 0  # a fresh run (load_checkpoint sets these)
set_args(args)
_set_timers(args)
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel()

import pretrain_gpt  # noqa: E402  the patched script, as a module
from gpt_builders import gpt_builder  # noqa: E402
from model_provider import model_provider  # noqa: E402

model = partial(model_provider, zeppelin.gpt_builder(gpt_builder))(pre_process=True, post_process=True)
layer = model.decoder.layers[0]
print("MODEL", type(model).__name__, type(layer.self_attention.core_attention).__name__, flush=True)
train, valid, test = pretrain_gpt.train_valid_test_datasets_provider([1, 1, 1])
data = RerunDataIterator(train)
for step in range(2):
    output, loss_func = pretrain_gpt.forward_step(data, model)
    loss, num_tokens, report = loss_func(output)
    loss.backward()
    print(f"STEP {step} {loss.item() / int(num_tokens):.4f} {int(num_tokens)} "
          f"{args.zeppelin_data_state['batches_consumed']}", flush=True)
train.close()
valid.close()

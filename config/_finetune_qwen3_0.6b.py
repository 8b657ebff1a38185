# Fine-tuning Qwen3-0.6B converted to a residual mode, the paper's recipe, shared by every
# finetune_qwen3_0.6b_<residual>.py. Get the checkpoint and data first (network needed once):
#   huggingface-cli download Qwen/Qwen3-0.6B --local-dir Qwen3-0.6B
#   python prepare_fineweb.py --tokenizer=Qwen3-0.6B --name=fineweb_edu_qwen3
init_from = 'Qwen3-0.6B'        # a local directory: config.json + model.safetensors
dataset = 'fineweb_edu_qwen3'   # tokenized with the checkpoint's own tokenizer.json
# the checkpoint's shapes (train.py checks them against the directory)
vocab_size = 151936
n_layer, n_embd, n_head, n_kv_head, head_dim = 28, 1024, 16, 8, 128
intermediate_size = 3072
rope_theta = 1e6
rms_norm_eps = 1e-6
tie_embeddings = True
n_blocks = 4                    # attnres / delta_block: 4 blocks of 7 layers
# 20k steps on 4 GPUs, batch 2 x accumulation 4 per GPU: 4 x 2 x 4 = 32 sequences per step
# (gradient_accumulation_steps counts micro-batches over all processes: 4 GPUs x 4)
batch_size = 2
gradient_accumulation_steps = 16
block_size = 2048
max_iters = 20000
lr_decay_iters = 20000
warmup_iters = 500
learning_rate = 5e-5            # the pretrained weights
routing_learning_rate = 5e-3    # the new routing parameters (queries, key norms, gates)
min_lr = 5e-6                   # the routing group decays in proportion, to 5e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
eval_interval = 500
eval_iters = 64
log_interval = 10

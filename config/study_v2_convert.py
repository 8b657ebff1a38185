# Study v2's conversion part (results/README.md, "Study v2"): the 12-layer standard model of seed 0 (part L12),
# exported with export.py and fine-tuned for 120 steps, as itself and converted to a routed mode, as the paper converts
# Qwen3-0.6B. The mode, res_gate, routing_init_std (the new queries: 0, the papers; N(0, std^2), the authors' code) and
# seed (the data order and the queries' draw) come from the command line (results/study_v2.sh convert).
exec(open('config/study_v2.py').read())
init_from = 'out/study_v2/convert/pretrained'   # a directory written by export.py
compile = False                 # 120 steps: compiling (30-100 s) would cost more than it saves
learning_rate = 3e-4            # the pretrained weights
routing_learning_rate = 3e-3    # the new routing parameters, 10x (the paper: 5e-5 and 5e-3)
min_lr = 3e-5
max_iters = 120
lr_decay_iters = 120
warmup_iters = 10
eval_interval = 10              # the recovery curve, from step 0 (the converted model before any step)
log_interval = 10

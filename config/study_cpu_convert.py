# The CPU study's conversion experiment (results/README.md): the study's 'standard' model (seed 0),
# exported with export.py, fine-tuned converted to another residual mode, as the paper converts
# Qwen3-0.6B. The residual mode and res_gate come from the command line (results/cpu_study.sh).
exec(open('config/study_cpu.py').read())
init_from = 'out/study/convert/pretrained'   # a directory written by export.py
seed = 7                        # another data order than the pretraining run's
learning_rate = 3e-4            # the pretrained weights
routing_learning_rate = 3e-3    # the new routing parameters, 10x (the paper: 5e-5 and 5e-3)
min_lr = 3e-5
max_iters = 120
lr_decay_iters = 120
warmup_iters = 10
eval_interval = 10              # the recovery curve
log_interval = 10

exec(open('config/_533m.py').read())
residual = 'full_attnres'
out_dir = 'out/full_attnres_533m'
wandb_run_name = 'full_attnres_533m'

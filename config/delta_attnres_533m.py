exec(open('config/_533m.py').read())
residual = 'delta_attnres'
out_dir = 'out/delta_attnres_533m'
wandb_run_name = 'delta_attnres_533m'

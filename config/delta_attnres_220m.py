exec(open('config/_220m.py').read())
residual = 'delta_attnres'
out_dir = 'out/delta_attnres_220m'
wandb_run_name = 'delta_attnres_220m'

"""What comes back from the workers: rank 0's results, the trained weights, predictions and rank 0's files.

Also what makes loggers whose runs live outside their directory (W&B, MLflow, Comet) log into the
driver's run from rank 0 (:mod:`.loggers`).
"""

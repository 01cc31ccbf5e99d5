"""What comes back from the workers: rank 0's results, the trained weights, predictions and rank 0's files."""

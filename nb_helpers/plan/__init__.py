"""What will run, and whether it fits, decided before the weights load: the compute dtype (dtypes), the model's shape
from config.json (architecture), the predicted peak (planner, activations), the settings that fit (choose, autofit),
the emulated card (budget), device memory as nvidia-smi sees it (memory), the checks before loading (preflight), the public models' shapes (catalog, reach) and
`python -m nb_helpers plan` (command). Nothing here imports the training code."""

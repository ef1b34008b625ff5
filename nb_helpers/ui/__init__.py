"""What the notebooks show: widgets bound to the config (02, 03), plots of run metrics, the reference-style table and
its warnings (04), and the committed GPU benchmark (04)."""

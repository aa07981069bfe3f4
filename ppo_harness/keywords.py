"""The keywords TRL's GRPOTrainer calls a reward function with beside the data's: shared by the
reward calls, which pass them, and the prompt files' check, which refuses a dataset column that
would take one's name."""

TRAINER_KEYWORDS = ("trainer_state", "log_extra", "log_metric")  # TRL's, beside the data's keywords

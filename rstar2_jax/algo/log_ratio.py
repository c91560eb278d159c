"""The bound every log-ratio is clamped to before anyone takes exp: verl's SAFETY_BOUND
(verl/trainer/ppo/rollout_corr_helper.py at volcengine/verl b178a3c). One definition for the KL
estimators, the off-policy corrections and the default of rl.loss.log_ratio_clamp."""

LOG_RATIO_BOUND = 20.0

"""moerl: reinforcement-learning post-training for Mixture-of-Experts language models.

Megatron-Core trains the policy; SGLang-API rollout servers (real SGLang on GPU, moerl's reference
server on CPU) behind sglang-router generate the rollouts; GSPO/GRPO/PPO optimise it.
"""

__version__ = "0.1.0"

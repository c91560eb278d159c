"""Rollouts: prompt format, tool-call parsing, the agent loop and the engines."""

from rstar2_jax.rollout.agent_loop import AgentConfig, run_agent
from rstar2_jax.rollout.prompt import FORMATS, PromptFormat, compact_format, make_format, tiny_format
from rstar2_jax.rollout.engines.sampling import SamplingParams
from rstar2_jax.rollout.tool_calls import ToolCall, parse_tool_calls
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn

__all__ = ["AgentConfig", "FORMATS", "PromptFormat", "SamplingParams", "ToolCall", "ToolRecord", "Trajectory", "Turn",
           "compact_format", "make_format", "parse_tool_calls", "run_agent", "tiny_format"]

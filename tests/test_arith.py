"""The demo task's SFT traces show the model what the real sandbox answers."""

import asyncio

import sandbox
from rstar2_jax.data import arith
from rstar2_jax.rollout.prompt import tool_output_text


def test_sft_error_trace_shows_the_sandbox_s_own_error_text():
    problem = arith.make_problems(1, seed=3)[0]
    pieces = arith.sft_trace(problem, "error_then_fix", None)
    broken = pieces[0][1].split('"code": ')[1]
    code = f"print({problem.expression}"
    assert code in broken

    async def run():
        async with sandbox.LocalSandbox(workers=1) as sb:
            return await sb.run(code, timeout=5.0)

    result = asyncio.run(run())
    assert result.status == "error"
    assert pieces[1] == ("tool", tool_output_text(result))
    assert "SyntaxError" in pieces[1][1]

"""`kvengine router`: one OpenAI front over several engines, routed by where blocks are held."""

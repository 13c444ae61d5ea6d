"""The Lua scripts the cluster index runs in Redis, and the ops its write script takes.

Each script is one round trip; staleness of an entry is decided inside the write script against
the node keys, not by the caller's membership view (which may not know a node that just joined).
"""

from __future__ import annotations

PUBLISH, UNPUBLISH, FORGET = b"1", b"0", b"2"  # the write script's ops, one byte per key

# ARGV: namespace-hash key prefix, node key prefix, packed 32-byte (namespace, hash) keys, one op
# per key ('1' add this node's entry, '0' remove this node's entry, '2' remove the given entry if
# it is stale), then one "node_id/incarnation" entry per key. Staleness is decided here, against
# the node keys, not by the reader's membership view, which may not know a node that just joined.
WRITE_LUA = """
local prefix, node_prefix, blob, ops = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local live = {}
for i = 1, #ops do
  local key = prefix .. string.sub(blob, i * 32 - 31, i * 32 - 16)
  local field = string.sub(blob, i * 32 - 15, i * 32)
  local op, entry = string.byte(ops, i), ARGV[4 + i]
  local node, inc = string.match(entry, '^([^/]+)/(.*)$')
  local skip = false
  if op == 50 then
    if live[node] == nil then
      live[node] = redis.call('GET', node_prefix .. node) or false
    end
    local cur = live[node]
    skip = cur and string.sub(cur, 1, #inc + 1) == inc .. ' '
  end
  local old = (not skip) and redis.call('HGET', key, field)
  if old then
    local kept = {}
    for e in string.gmatch(old, '[^ ]+') do
      if (op == 50 and e ~= entry) or (op ~= 50 and string.sub(e, 1, #node + 1) ~= node .. '/') then
        kept[#kept + 1] = e
      end
    end
    if op == 49 then kept[#kept + 1] = entry end
    if #kept > 0 then
      redis.call('HSET', key, field, table.concat(kept, ' '))
    else
      redis.call('HDEL', key, field)
    end
  elseif op == 49 then
    redis.call('HSET', key, field, entry)
  end
end
return #ops
"""

# KEYS[1]: the namespace's hash. ARGV[1]: packed 16-byte block hashes. Returns the entries of the
# blocks before the first unclaimed one, joined by newlines (one bulk string: cheap to parse).
LOOKUP_LUA = """
local blob = ARGV[1]
local fields = {}
for i = 1, #blob / 16 do fields[i] = string.sub(blob, i * 16 - 15, i * 16) end
local values = redis.call('HMGET', KEYS[1], unpack(fields))
local out = {}
for i = 1, #fields do
  if not values[i] then break end
  out[i] = values[i]
end
return table.concat(out, '\\n')
"""

DEREGISTER_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

"""The Lua scripts that change a context's keys in Redis (context_keys.py), each one atomic on
the context's shard. Each checks the version Redis holds, so two nodes writing one context can
never interleave their commits: the one behind is told so (STALE) and nothing changes.

A commit sent again after its reply was lost (a connection reset, then the client library's
retry) finds its own record last in the log and succeeds without appending it twice.
"""
from __future__ import annotations

# KEYS: meta, log. ARGV: version, record.
# Returns {1, log_bytes} when the log holds the record, {0, the version Redis holds or -1} when not.
COMMIT = """
local held = tonumber(redis.call('HGET', KEYS[1], 'version'))
local version = tonumber(ARGV[1])
if held == version and redis.call('LINDEX', KEYS[2], -1) == ARGV[2] then
  return {1, tonumber(redis.call('HGET', KEYS[1], 'log_bytes'))}
end
if held ~= version - 1 then
  return {0, held or -1}
end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'version', version)
return {1, redis.call('HINCRBY', KEYS[1], 'log_bytes', #ARGV[2])}
"""

# KEYS: meta, snap, log. ARGV: version, record, mode.
# mode "fold": replace the snapshot and its log, only while Redis holds exactly `version`;
# mode "adopt": write it only where Redis holds no version of the context, or an older one.
# Returns 1 when written, 0 when not.
SNAPSHOT = """
local held = tonumber(redis.call('HGET', KEYS[1], 'version'))
local version = tonumber(ARGV[1])
if ARGV[3] == 'fold' and held ~= version then return 0 end
if ARGV[3] == 'adopt' and held ~= nil and held >= version then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[1], 'version', version, 'log_bytes', 0)
return 1
"""

# KEYS: meta, log. ARGV: version, record.
# Takes back a commit this node could not make durable on its own disk, only while it is still
# the newest in Redis. Returns 1 when taken back, 0 when not.
UNCOMMIT = """
if tonumber(redis.call('HGET', KEYS[1], 'version')) ~= tonumber(ARGV[1])
   or redis.call('LINDEX', KEYS[2], -1) ~= ARGV[2] then
  return 0
end
redis.call('RPOP', KEYS[2])
redis.call('HSET', KEYS[1], 'version', ARGV[1] - 1)
redis.call('HINCRBY', KEYS[1], 'log_bytes', -#ARGV[2])
return 1
"""

"""A Redis script call sent now and answered later, on the caller's own thread: the scheduler
sends a commit, makes its journal durable while Redis takes it, then reads Redis's answer. One
thread, so the overlap costs no thread hand-off (on a loaded host a hand-off waits for a core).

The quick way is one pooled connection to the server that holds the keys (on Redis Cluster, the
node that serves their slot); anything unusual on it (the script not loaded yet, a slot that moved,
a connection Redis closed) is answered by the client's own call instead, which loads the script,
follows the cluster and retries. The scripts count a call sent twice once.
"""
from __future__ import annotations

from redis.cluster import RedisCluster
from redis.commands.core import Script

from mcpd.cluster.redis_client import REDIS_ERRORS


class ScriptCall:
    def __init__(self, client, script: Script, keys: list[str], args: list):
        self.script, self.keys, self.args = script, keys, args
        self.server = self.connection = None
        try:
            self.server = (client.get_redis_connection(client.get_node_from_key(keys[0]))
                           if isinstance(client, RedisCluster) else client)
            self.connection = self.server.connection_pool.get_connection()
            self.connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except REDIS_ERRORS:
            self._give_back(broken=True)

    def result(self):
        """Redis's answer; raises what the client's own call raises when Redis cannot answer."""
        if self.connection is not None:
            try:
                answer = self.server.parse_response(self.connection, "EVALSHA")
            except REDIS_ERRORS:
                self._give_back(broken=True)
            else:
                self._give_back(broken=False)
                return answer
        return self.script(keys=self.keys, args=self.args)

    def _give_back(self, broken: bool) -> None:
        if self.connection is None:
            return
        if broken:   # its state is unknown: what is left of an answer must not meet the next call
            self.connection.disconnect()
        self.server.connection_pool.release(self.connection)
        self.connection = None

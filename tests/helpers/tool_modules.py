"""Source text of the tools modules tests write for the tools' worker to import: pieces shared between tests."""

# A TRL-form environment: reset(**row) reads the row's ``start`` (0 without one), ``bump`` is its tool, get_reward its
# counter's value.
COUNTER = '''
class Counter:
    def reset(self, **row):
        self.n = int(row.get("start", 0))
        return f" (the counter starts at {self.n})"

    def bump(self, by: int) -> str:
        """Adds to the counter.

        Args:
            by: how much
        """
        self.n += by
        return str(self.n)

    def get_reward(self) -> float:
        return float(self.n)
'''

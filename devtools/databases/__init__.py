"""The local databases the tools use: `ensure` creates DATABASE_URL's PostgreSQL database if
missing (`make`), `scratch` claims a Redis database before the chaos run or the bench flushes it."""

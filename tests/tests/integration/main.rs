//! Integration tests: a real nats-server per test, the real service binaries as processes (so
//! faults are real SIGKILLs), real tmux and the bundled mock agent. Rules cited as R1..R15.

mod adapters;
mod agents;
mod asyncapi;
mod bad_input;
mod bench;
mod campaign_found;
mod cancel_races;
mod children;
mod claude;
mod codex;
mod consume;
mod dashboard;
mod delivery;
mod deployed;
mod dev;
mod discovery;
mod examples;
mod faults;
mod health;
mod hosts;
mod house;
mod kv;
mod lanes;
mod lifecycle;
mod mcp;
mod metrics;
mod provision;
mod real_cli;
mod retention;
mod runs;
mod schedules;
mod stack;
mod stop;
mod tls;

//! `hotstart env ...`: dependency snapshots (key, ensure, ls, gc).

use std::path::PathBuf;

use clap::{Args, Subcommand};
use hotstart_snapshot::{KeyInputs, KeySpec};

#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// Print the snapshot key of an environment: blake3 over the lock files' bytes, the
    /// interpreter's version and ABI, the platform (arch, libc), the install command and the
    /// target path.
    ///
    /// Example:
    ///   hotstart env key --lock requirements.txt --target /opt/venv -- \
    ///       sh -c 'python3 -m venv /opt/venv && /opt/venv/bin/pip install -r requirements.txt'
    ///
    /// Same inputs give the same key on any machine; any change gives another key. Without
    /// --target (or with --relocatable) the target is left out: the key of a relocatable
    /// snapshot.
    #[command(verbatim_doc_comment)]
    Key(KeyArgs),
}

#[derive(Debug, Args)]
pub struct KeySpecArgs {
    /// A lock or requirements file whose bytes enter the key (repeat for several; order counts).
    #[arg(long = "lock", value_name = "FILE", required = true)]
    locks: Vec<PathBuf>,
    /// The interpreter the environment is for; its version, ABI and installation path enter the
    /// key.
    #[arg(long, default_value = "python3", env = "HOTSTART_ENV_PYTHON")]
    python: String,
    /// Leave the target path out of the key; a restore at another path rewrites pyvenv.cfg, the
    /// scripts' shebangs and other text files that name the old path.
    #[arg(long)]
    relocatable: bool,
}

#[derive(Debug, Args)]
pub struct KeyArgs {
    #[command(flatten)]
    spec: KeySpecArgs,
    /// The directory the environment is installed into.
    #[arg(long, value_name = "DIR")]
    target: Option<PathBuf>,
    /// Also print every input of the key, as JSON.
    #[arg(long)]
    explain: bool,
    /// The install command (after `--`).
    #[arg(last = true, value_name = "INSTALL COMMAND")]
    command: Vec<String>,
}

impl KeySpecArgs {
    fn spec(&self, target: Option<PathBuf>, command: Vec<String>) -> KeySpec {
        KeySpec {
            locks: self.locks.clone(),
            python: self.python.clone(),
            command,
            target: if self.relocatable { None } else { target },
        }
    }
}

pub async fn run(cmd: EnvCommand) -> anyhow::Result<()> {
    match cmd {
        EnvCommand::Key(args) => key(args).await,
    }
}

async fn key(args: KeyArgs) -> anyhow::Result<()> {
    let spec = args.spec.spec(args.target, args.command);
    let inputs = tokio::task::spawn_blocking(move || KeyInputs::gather(&spec)).await??;
    println!("{}", inputs.key());
    if args.explain {
        println!("{}", serde_json::to_string_pretty(&inputs)?);
    }
    Ok(())
}

//! `hotstart tls init`: the files of encrypted peer links, a cluster CA and a certificate per
//! node (`hotstart_sidecar::tls::init`).

use std::path::PathBuf;

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum TlsCommand {
    /// Make a new cluster CA in OUT (ca.crt, ca.key) and, for each NODE, a directory OUT/NODE
    /// holding ca.crt, tls.crt and tls.key: mount it on that node (a Kubernetes TLS Secret has
    /// this layout) and pass it to `hotstart serve --tls-dir`. Keep ca.key off the nodes.
    #[command(
        after_help = "Example:\n  hotstart tls init /secure/hotstart-tls node-a node-b node-c\n  \
        kubectl create secret generic hotstart-tls-node-a --from-file=/secure/hotstart-tls/node-a"
    )]
    Init {
        /// Directory for the CA and the nodes' directories; one that holds a CA already is
        /// refused.
        out: PathBuf,
        /// Node ids (`hotstart serve --node-id`), one certificate each.
        #[arg(required = true)]
        nodes: Vec<String>,
        /// Days the certificates are valid.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

pub fn run(cmd: TlsCommand) -> anyhow::Result<()> {
    match cmd {
        TlsCommand::Init { out, nodes, days } => {
            hotstart_sidecar::tls::init(&out, &nodes, days)?;
            println!(
                "CA in {} (keep ca.key off the nodes); for each node, mount {}/<node> and pass \
                 it as --tls-dir",
                out.display(),
                out.display()
            );
            Ok(())
        }
    }
}
